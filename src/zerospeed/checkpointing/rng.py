"""The RNG tracker for tensor-parallel dropout (Megatron's / DeepSpeed's ``get_cuda_rng_tracker``).

Tensor-parallel ranks hold different shards of one activation, so dropout inside a
tensor-parallel region must draw *different* masks on each rank (``model-parallel-rng`` state),
while dropout outside must draw the *same* mask on every rank of a tensor-parallel group (the
default generator, seeded identically). The tracker keeps named generator states and
``fork(name)`` swaps one in for a block of code, then saves what the block advanced it to and
restores the default state.

Decisions:

* Device-agnostic: states are those of the default generator of the device in use, CUDA when it
  is available, the CPU generator otherwise, so TP dropout and checkpoint recomputation behave
  the same in CPU tests as on GPU. The names keep DeepSpeed's ``cuda`` spelling.
* ``model_parallel_cuda_manual_seed(seed)`` follows Megatron: the default generator gets ``seed``
  (same on all TP ranks), the tracker's ``model-parallel-rng`` gets ``seed + 2718 + tp_rank``.
  The TP rank comes from the mpu given to :func:`zerospeed.checkpointing.configure`, else from the
  current mesh (:func:`zerospeed.comm.mesh.get_mesh`), else 0.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"


def _on_cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def get_device_rng_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if _on_cuda() else torch.get_rng_state()


def set_device_rng_state(state: torch.Tensor) -> None:
    if _on_cuda():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class CudaRNGStatesTracker:
    """Named generator states; ``fork(name)`` runs a block with one of them."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"RNG tracker: seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"RNG tracker: state {name!r} already exists")
        self.seeds_.add(seed)
        saved = get_device_rng_state()
        if _on_cuda():
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states_[name] = get_device_rng_state()
        set_device_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"RNG tracker: no state named {name!r} (call model_parallel_cuda_manual_seed first)")
        saved = get_device_rng_state()
        set_device_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = get_device_rng_state()
            set_device_rng_state(saved)


_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    return _TRACKER


def _tp_rank(mpu: Any) -> int:
    if mpu is not None:
        return int(mpu.get_model_parallel_rank())
    from zerospeed.comm.mesh import get_mesh

    mesh = get_mesh()
    return int(mesh.get_model_parallel_rank()) if mesh is not None else 0


def model_parallel_cuda_manual_seed(seed: int, mpu: Any = None) -> None:
    """Seed the default generator with ``seed`` and the tracker's TP state with ``seed + 2718 + tp_rank``."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"model_parallel_cuda_manual_seed: seed must be an int, got {seed!r}")
    if mpu is None:
        from zerospeed.checkpointing.settings import current_mpu

        mpu = current_mpu()
    tp_seed = seed + 2718 + _tp_rank(mpu)
    if _on_cuda():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, tp_seed)


def capture_rng_states() -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    """CPU state, CUDA state (None without CUDA) and the tracker's states, for a recomputation."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state() if _on_cuda() else None), _TRACKER.get_states()


@contextlib.contextmanager
def restored_rng_states(states: tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]) -> Iterator[None]:
    """Run a block with the captured states, then put every generator back as it was."""
    cpu, cuda, tracked = states
    saved = capture_rng_states()
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
    _TRACKER.set_states(tracked)
    try:
        yield
    finally:
        torch.set_rng_state(saved[0])
        if saved[1] is not None:
            torch.cuda.set_rng_state(saved[1])
        _TRACKER.set_states(saved[2])
