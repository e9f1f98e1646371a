"""Device parametrization for the parity tests that make sense on one GPU (``make gpu-check``).

``DEVICES`` is the list to parametrize with: ``"cpu"`` always (a real test on every machine), and
``"cuda"``, skipped with the reason "no CUDA device" where ``torch.cuda.is_available()`` is False.

``world_of_one(device)`` gives a test the process group the engine expects, for one rank: gloo on
``cpu``, NCCL on ``cuda`` (so ``comm.device_for_backend()`` puts the model on the GPU), and tears it
down after the test with the suite's own teardown (``zerospeed.comm.lifecycle.shutdown``, a fresh
mesh), so the next test may pick the other backend.

Numerics on CUDA are pinned so that bounds can come from the arithmetic, as on CPU:

* TF32 is off (``torch.set_float32_matmul_precision("highest")``, cuDNN's ``allow_tf32`` False), so an
  fp32 matmul rounds at fp32's 24 bits, not TF32's 11;
* deterministic algorithms are requested (``warn_only``: an op without a deterministic kernel warns
  instead of failing) with cuBLAS's fixed workspace, so the reference run and the engine run do the
  same sums in the same order and differ only where the engine's own arithmetic differs (flat
  optimizer state, the clipping norm's order), exactly as on CPU. With that, the CPU tolerances hold.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch

NO_CUDA = "no CUDA device"
HAS_CUDA = torch.cuda.is_available()

#: parametrize a test with ``@pytest.mark.parametrize("device", DEVICES)``
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA), id="cuda")]


def pin_cuda_numerics() -> None:
    """TF32 off and deterministic kernels (see the module docstring). Harmless without CUDA."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True, warn_only=True)


def unpin_cuda_numerics() -> None:
    torch.use_deterministic_algorithms(False)


def backend_for(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def teardown_world() -> None:
    """What tests/conftest.py does after each module, here after one test."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from zerospeed.comm.lifecycle import shutdown

        shutdown(timeout_s=5.0)
    from zerospeed.comm.mesh import reset_mesh

    reset_mesh()
    try:
        from zerospeed.moe.groups import reset_expert_groups
    except ImportError:
        return
    reset_expert_groups()


@contextlib.contextmanager
def world_of_one(device: str) -> Iterator[torch.device]:
    """A world of one on ``device``'s backend; yields the device the engine computes on."""
    from zerospeed import comm

    teardown_world()  # a group left by an earlier test of this module (another backend) goes first
    if device == "cuda":
        pin_cuda_numerics()
    comm.init_distributed(dist_backend=backend_for(device))
    try:
        got = comm.device_for_backend()
        assert got.type == device, f"the engine would compute on {got}, not {device}"
        yield got
    finally:
        teardown_world()
        if device == "cuda":
            unpin_cuda_numerics()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def to_cpu(tree):
    """Tensors of a (nested) result, detached, as float32 on the CPU (for comparing across devices)."""
    if torch.is_tensor(tree):
        return tree.detach().to("cpu", torch.float32)
    if isinstance(tree, dict):
        return {k: to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_cpu(v) for v in tree)
    return tree
