"""The accelerator interface (DeepSpeed's ``DeepSpeedAccelerator`` names), and what CPU and CUDA share.

The methods a training script calls are the same on both devices; the subclasses say how a device
is named, counted and measured. Names that only make sense for DeepSpeed's C++/CUDA op builders
(``create_op_builder``, ``get_op_builder``, ``op_builder_dir``, ``build_extension``) raise
``NotImplementedError`` naming the method: zerospeed compiles no extensions.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch


class Accelerator:
    _name = "abstract"
    _communication_backend_name = "gloo"
    _compile_backend = "inductor"

    # -- identity ---------------------------------------------------------------------------------
    def name(self) -> str:  # DeepSpeed exposes it as a method (and ``_name``)
        return self._name

    def device_name(self, device_index: int | None = None) -> str:
        raise NotImplementedError

    def current_device_name(self) -> str:
        raise NotImplementedError

    def device(self, device_index: int | None = None) -> Any:
        raise NotImplementedError

    def is_available(self) -> bool:
        raise NotImplementedError

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def is_synchronized_device(self) -> bool:
        return False

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    def is_triton_supported(self) -> bool:
        return False

    # -- RNG --------------------------------------------------------------------------------------
    def random(self) -> Any:
        return torch.random

    def manual_seed(self, seed: int) -> Any:
        return torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> Any:
        return torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.set_rng_state(new_state)

    def default_generator(self, device_index: int | None = None) -> torch.Generator:
        return torch.default_generator

    # -- dtypes -----------------------------------------------------------------------------------
    def is_fp64_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        out = [torch.float32]
        if self.is_fp16_supported():
            out.append(torch.float16)
        if self.is_bf16_supported():
            out.append(torch.bfloat16)
        return out

    def BFloat16Tensor(self, *args: Any) -> torch.Tensor:  # noqa: N802 - DeepSpeed's names
        return self._typed(torch.bfloat16, args)

    def HalfTensor(self, *args: Any) -> torch.Tensor:  # noqa: N802
        return self._typed(torch.float16, args)

    def FloatTensor(self, *args: Any) -> torch.Tensor:  # noqa: N802
        return self._typed(torch.float32, args)

    def DoubleTensor(self, *args: Any) -> torch.Tensor:  # noqa: N802
        return self._typed(torch.float64, args)

    def IntTensor(self, *args: Any) -> torch.Tensor:  # noqa: N802
        return self._typed(torch.int32, args)

    def LongTensor(self, *args: Any) -> torch.Tensor:  # noqa: N802
        return self._typed(torch.int64, args)

    def ByteTensor(self, *args: Any) -> torch.Tensor:  # noqa: N802
        return self._typed(torch.uint8, args)

    def _typed(self, dtype: torch.dtype, args: tuple[Any, ...]) -> torch.Tensor:
        device = self.current_device_name()
        return torch.tensor(*args, dtype=dtype, device=device) if args else torch.empty(0, dtype=dtype, device=device)

    # -- memory placement -------------------------------------------------------------------------
    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if tensor.device.type == "cpu" and torch.cuda.is_available() else False

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self.device_name()

    # -- profiling markers and graphs (no-ops unless the device has them) ------------------------
    def range_push(self, msg: str) -> None:
        return None

    def range_pop(self) -> None:
        return None

    def lazy_call(self, callback: Any) -> Any:
        return callback()

    def is_current_stream_capturing(self) -> bool:
        return False

    def create_graph(self) -> Any:
        return None

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> Any:
        return contextlib.nullcontext()

    def replay_graph(self, graph: Any) -> None:
        return None

    # -- compile ----------------------------------------------------------------------------------
    def get_compile_backend(self) -> str:
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        self._compile_backend = backend

    # -- environment ------------------------------------------------------------------------------
    def visible_devices_envs(self) -> list[str]:
        return []

    def set_visible_devices_envs(self, current_env: dict[str, str], local_accelerator_ids: list[int]) -> None:
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def export_envs(self) -> list[str]:
        return []

    # -- op builders: zerospeed compiles no extensions ---------------------------------------------
    def _no_ops(self, method: str) -> Any:
        raise NotImplementedError(f"get_accelerator().{method}: zerospeed builds no C++/CUDA extensions; its "
                                  "optimizers and kernels are plain PyTorch (zerospeed.ops)")

    def op_builder_dir(self) -> Any:
        return self._no_ops("op_builder_dir")

    def create_op_builder(self, class_name: str) -> Any:
        return self._no_ops("create_op_builder")

    def get_op_builder(self, class_name: str) -> Any:
        return self._no_ops("get_op_builder")

    def build_extension(self) -> Any:
        return self._no_ops("build_extension")

    def __repr__(self) -> str:
        return f"<zerospeed accelerator {self._name!r}>"


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))
