"""Import-time noise from optional dependencies, silenced at the logger that prints it (issue #33).

Installed when ``zerospeed`` is imported (nothing here imports torch); each filter drops one known message and only
where it says nothing the user can act on:

* torchao's ``Failed to load .../torchao/_C_mxfp8...so`` (and ``_C_cutlass_90a``), printed by every import of
  torchao (which transformers' model code imports): the PyPI wheel's extension libraries are CUDA kernels, which
  cannot load into a CPU-only torch (``torch.version.cuda is None``). With a CUDA build of torch the message is
  kept: there it is a real failure.
* torch's ``<enum '...'> is an Enum subclass ... register_constant() ... deprecated``, printed once per enum that
  torchao registers with torch's pytree at import: a deprecation aimed at torchao's code, not the user's. The
  filter looks at the enum's module, so the same warning about any other package's enum still prints.

A script that imports transformers' models (or torchao) before ``zerospeed`` sees the messages: they are printed
before any zerospeed code runs.
"""

from __future__ import annotations

import logging
import os
import sys


def _torch_without_cuda() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and getattr(getattr(torch, "version", None), "cuda", "?") is None


class TorchaoKernelLoadFilter(logging.Filter):
    """Drops torchao's failure to load its own (CUDA) extension libraries into a CPU-only torch."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if not msg.startswith("Failed to load ") or not _torch_without_cuda():
            return True
        path = msg[len("Failed to load "):].split(":", 1)[0]
        name = os.path.basename(path)
        return not (os.path.basename(os.path.dirname(path)) == "torchao" and name.startswith("_C") and
                    name.endswith(".so"))


class TorchaoEnumRegistrationFilter(logging.Filter):
    """Drops torch's deprecation of ``register_constant()`` on Enum subclasses when the enum is torchao's."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "is an Enum subclass" not in str(record.msg) or not isinstance(record.args, tuple) or not record.args:
            return True
        cls = record.args[0]
        return not (isinstance(cls, type) and str(getattr(cls, "__module__", "")).split(".")[0] == "torchao")


_FILTERS = {"torchao": TorchaoKernelLoadFilter, "torch.utils._pytree": TorchaoEnumRegistrationFilter}


def install() -> None:
    """Add the filters to their loggers (once)."""
    for name, kind in _FILTERS.items():
        log = logging.getLogger(name)
        if not any(isinstance(f, kind) for f in log.filters):
            log.addFilter(kind())


__all__ = ["TorchaoEnumRegistrationFilter", "TorchaoKernelLoadFilter", "install"]
