"""``deepspeed.git_version_info``: what the installed package is and which compiled ops it has (issue 27).

DeepSpeed writes this module at build time; ``ds_report``, DeepSpeed's own test harness (``tests/unit/util.py``
reads ``torch_info``) and scripts read it. zerospeed's answers, computed from this installation:

* ``version``: zerospeed's version; ``git_hash`` / ``git_branch``: ``"unknown"``, as an installed DeepSpeed wheel
  built outside a git checkout reports;
* ``installed_ops``: DeepSpeed's op names (those its CPU build lists), each ``False``: zerospeed compiles none of
  DeepSpeed's op extensions (its optimizers and I/O are torch code or its own kernels, chosen at start-up);
* ``accelerator_name``: ``"cuda"`` when torch sees a CUDA device, else ``"cpu"`` (zerospeed's two devices);
* ``torch_info``: torch's ``major.minor`` version, bf16 support, and the CUDA / NCCL / HIP versions torch was built
  with (``"0.0"`` when absent), the keys DeepSpeed's build records.
"""

from __future__ import annotations

import torch

from zerospeed._version import __version__ as version

git_hash = "unknown"
git_branch = "unknown"

#: DeepSpeed 0.19.8's op names (the list its CPU build records); zerospeed builds none of these extensions
installed_ops: dict[str, bool] = {name: False for name in (
    "deepspeed_not_implemented", "async_io", "deepspeed_ccl_comm", "deepspeed_shm_comm", "cpu_adagrad", "cpu_adam",
    "cpu_lion", "fused_adam", "pin_memory")}

accelerator_name = "cuda" if torch.cuda.is_available() else "cpu"


def _major_minor(text: str | None) -> str:
    parts = (text or "").split("+")[0].split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 and all(p.isdigit() for p in parts[:2]) else "0.0"


def _nccl_version() -> str:
    try:
        major, minor, *_ = torch.cuda.nccl.version()
        return f"{major}.{minor}"
    except Exception:  # torch built without NCCL (CPU wheels): DeepSpeed records "0.0"
        return "0.0"


torch_info: dict[str, object] = {
    "version": _major_minor(torch.__version__),
    "bf16_support": bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()),
    "cuda_version": _major_minor(torch.version.cuda),
    "nccl_version": _nccl_version() if torch.version.cuda else "0.0",
    "hip_version": _major_minor(getattr(torch.version, "hip", None)),
}

__all__ = ["accelerator_name", "git_branch", "git_hash", "installed_ops", "torch_info", "version"]
