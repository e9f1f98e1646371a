"""Optimizers: the DeepSpeed-config optimizer factory and the Lamb implementation."""

from zerospeed.ops.lamb import Lamb
from zerospeed.ops.optimizers import build_optimizer, resolve_client_optimizer

__all__ = ["Lamb", "build_optimizer", "resolve_client_optimizer"]


from zerospeed._submodules import lazy_submodules as _lazy_submodules

__getattr__ = _lazy_submodules(__name__)  # zerospeed.<package>.<submodule> after `import zerospeed` (issue #27)
