"""``zerospeed.accelerator``: DeepSpeed's accelerator interface (``get_accelerator()``).

Scripts written for DeepSpeed ask ``get_accelerator()`` which device to use, how many there are,
for memory statistics and for the communication backend. zerospeed offers the same names for the
two devices it runs on, CPU and CUDA.

Selection, as DeepSpeed does it: ``DS_ACCELERATOR`` (``cpu`` or ``cuda``) wins; otherwise CUDA when
``torch.cuda`` has a device, else the CPU. ``DS_ACCELERATOR`` naming a device DeepSpeed knows but
zerospeed does not build for (``xpu``, ``npu``, ``mps``, ``hpu``...) is an error naming it, as is
``cuda`` on a machine without CUDA. ``set_accelerator(obj)`` replaces the choice (any object of
:class:`Accelerator`'s interface).
"""

from __future__ import annotations

from zerospeed.accelerator.abstract import Accelerator
from zerospeed.accelerator.cpu import CPUAccelerator
from zerospeed.accelerator.cuda import CUDAAccelerator
from zerospeed.accelerator.real import get_accelerator, is_current_accelerator_supported, set_accelerator

__all__ = ["Accelerator", "CPUAccelerator", "CUDAAccelerator", "get_accelerator",
           "is_current_accelerator_supported", "set_accelerator"]


from zerospeed._submodules import lazy_submodules as _lazy_submodules

__getattr__ = _lazy_submodules(__name__)  # zerospeed.<package>.<submodule> after `import zerospeed` (issue #27)
