"""DeepSpeed's ZeRO-3 user API: ``zero.Init``, ``zero.GatheredParameters``, external parameters.

* ``with zero.Init(config_dict_or_path=ds_config): model = MyModel()`` partitions each module's
  parameters as soon as its constructor returns (see :mod:`zerospeed.zero.stage3.construction`),
  so no rank ever materialises the whole model; ``initialize`` then adopts the partitioned model.
* ``with zero.GatheredParameters(params, modifier_rank=None):`` gathers full parameters for
  reading; with ``modifier_rank=r`` the values rank ``r`` leaves in them are broadcast on exit and
  every rank re-partitions them (its 16-bit shard and its fp32 master shard). Without a modifier
  rank, modifications are discarded. Before an engine exists, a parameter may even change shape
  (``resize_token_embeddings``): its bucket is rebuilt for the new shape
  (:mod:`zerospeed.zero.stage3.reshape`); under an engine a shape change is refused. On parameters that are not partitioned it does nothing.
* ``zero.register_external_parameter(module, param)``: ``module``'s forward uses ``param``
  although another module owns it; ZeRO-3 gathers it around ``module``'s forward and backward.
  Tied parameters (one ``Parameter`` registered in two modules, e.g. a tied embedding and LM head)
  are detected without registration.

Initialisation after a module was partitioned (HF's ``post_init``, a parent's ``nn.init`` calls, a
``reset_parameters`` pass) runs on gathered parameters (:mod:`zerospeed.zero.init_capture`), so a
model built under ``zero.Init`` equals the one built without it (same seed).

Decisions: ``zero.Init``'s dtype is ``dtype=`` if given, else the config's precision (bf16 / fp16),
else each parameter keeps its dtype. ``config`` may omit the batch size keys (they do not matter
here). ``remote_device="cpu"`` keeps shards in CPU memory (the engine moves nothing back: use it
with CPU training); NVMe and model-parallel options are not supported and raise.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerospeed.zero.gathered import (GatheredParameters, is_partitioned, register_external_parameter,
                                     unregister_external_parameter)

_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
_active: list[Any] = []  # ConstructionPartitioner stack of nested Init contexts


def _parse_config(config: Any) -> Any:
    """``zero.Init``'s ``config_dict_or_path`` (a public entry that takes the user's config): parsed by the config
    package, whose batch sizes may be left out (they do not matter here).

    Returns what ``zero.Init`` reads: ``(precision, stage3_collective_timeout_s)``, or None without a config. A
    config that still holds HF ``"auto"`` values the parser resolves only with the Trainer's arguments
    (``optimizer.params.lr``, ``scheduler.params.warmup_num_steps``... - Transformers' ``from_pretrained`` passes
    its DeepSpeed config before the Trainer has filled them) is read section by section: ``fp16``, ``bf16`` and
    ``zero_optimization``, the only ones that matter here (as DeepSpeed's ``zero.Init``, which takes an
    ``"auto"`` as unset). An ``"auto"`` left in those sections' math keys (``bf16.enabled``) is still refused.
    """
    from zerospeed.config import ConfigError, ZeroSpeedConfig, load_config, load_section

    if config is None:
        return None
    if isinstance(config, ZeroSpeedConfig):
        return config.precision, config.zero_optimization.stage3_collective_timeout_s
    from zerospeed import comm

    try:
        cfg = load_config(config, dp_world_size=comm.get_world_size(), batch_optional=True)
        return cfg.precision, cfg.zero_optimization.stage3_collective_timeout_s
    except ConfigError as exc:
        if "'auto'" not in str(exc) or "outside the HF Trainer" not in str(exc):
            raise
    fp16, bf16 = load_section(config, "fp16"), load_section(config, "bf16")
    precision = "fp16" if fp16.enabled else "bf16" if bf16.enabled else "fp32"
    return precision, load_section(config, "zero_optimization").stage3_collective_timeout_s


class Init:
    """Partition parameters as the model is built (DeepSpeed's ``deepspeed.zero.Init``)."""

    def __init__(self, module: nn.Module | None = None, data_parallel_group: dist.ProcessGroup | None = None,
                 mem_efficient_linear: bool = True, remote_device: str | None = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: torch.dtype | None = None, mpu: Any = None, zero_param_parallel_group: Any = None,
                 zero_quantized_weights: bool = False, zero_quantized_nontrainable_weights: bool = False,
                 sequence_data_parallel_group: Any = None, param_swapper: Any = None) -> None:
        del mem_efficient_linear, pin_memory  # DeepSpeed knobs with no effect here
        for name, value in (("mpu", mpu), ("zero_param_parallel_group", zero_param_parallel_group),
                            ("sequence_data_parallel_group", sequence_data_parallel_group),
                            ("param_swapper", param_swapper)):
            if value is not None:
                raise ValueError(f"zero.Init: {name} is not supported by zerospeed; pass None")
        if zero_quantized_weights or zero_quantized_nontrainable_weights:
            raise ValueError("zero.Init: quantized weights (ZeRO++) are not supported by zerospeed")
        if remote_device not in (None, "none", "cpu"):
            raise ValueError(f"zero.Init: remote_device={remote_device!r} is not supported (None or 'cpu')")
        if dtype is not None and dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"zero.Init: dtype must be torch.float32, torch.float16 or torch.bfloat16, got {dtype}")
        self.enabled = enabled
        if not enabled:
            return
        from zerospeed import comm

        comm.init_distributed()
        cfg = _parse_config(config if config is not None else config_dict_or_path)
        self.dtype = dtype if dtype is not None else (_DTYPES[cfg[0]] if cfg is not None else None)
        self.timeout_s = cfg[1] if cfg is not None else None
        self.group = data_parallel_group
        self.device = torch.device("cpu") if remote_device == "cpu" else comm.device_for_backend()
        self._partitioner: Any = None
        if module is not None:
            self._make_partitioner().partition_module(module)

    def _make_partitioner(self) -> Any:
        from zerospeed.zero.stage3.construction import ConstructionPartitioner

        return ConstructionPartitioner(self.group, self.dtype, self.device, self.timeout_s)

    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        if _active:  # nested: the outermost context's hooks already see every registration
            return self
        self._partitioner = self._make_partitioner()
        self._partitioner.start()
        _active.append(self._partitioner)
        from zerospeed.zero.init_capture import InitCapture

        self._capture = InitCapture()  # init code (HF post_init, nn.init, reset_parameters) sees whole tensors
        self._capture.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled and self._partitioner is None and _active:
            _active[-1].flush()  # nested: what was built inside it is partitioned now, as DeepSpeed's exit does
            return
        if not self.enabled or self._partitioner is None:
            return
        self._capture.stop()
        _active.remove(self._partitioner)
        partitioner, self._partitioner = self._partitioner, None
        partitioner.stop()


__all__ = ["GatheredParameters", "Init", "is_partitioned", "register_external_parameter",
           "unregister_external_parameter"]
