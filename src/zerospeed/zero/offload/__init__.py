"""ZeRO-Offload / ZeRO-Infinity: optimizer states (and stage-3 parameters) in host memory or on NVMe.

* :mod:`~zerospeed.zero.offload.checks` - what an offload config needs, checked up front;
* :mod:`~zerospeed.zero.offload.tier` - which buckets are offloaded (``ratio``) and the
  offloaded Adam step over them (CPU memory or NVMe swap);
* :mod:`~zerospeed.zero.offload.swap` - the NVMe swap files of optimizer states;
* :mod:`~zerospeed.zero.offload.host_held` - NVMe swap of a host-held (non-Adam) optimizer's states.
"""

from zerospeed.zero.offload.checks import OFFLOADABLE_OPTIMIZERS, check_nvme_dir, check_offload

__all__ = ["OFFLOADABLE_OPTIMIZERS", "check_nvme_dir", "check_offload"]
