"""Mixture of experts, DeepSpeed's way: ``zerospeed.moe.layer.MoE`` (top-1/top-2 gating with
capacity, expert parallelism over all-to-all, grouped experts), ``zerospeed.moe.utils`` (DeepSpeed's
helper names) and the registry of expert parameters (:mod:`zerospeed.moe.registry`)."""


from zerospeed._submodules import lazy_submodules as _lazy_submodules

__getattr__ = _lazy_submodules(__name__)  # zerospeed.<package>.<submodule> after `import zerospeed` (issue #27)
