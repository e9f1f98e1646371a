"""Which optimizers ZeRO can shard and offload, and how (a table the strategies and the checks share).

* element-wise (:data:`ELEMENTWISE_OPTIMIZERS`, by class name): running them on flat shards equals running
  them on whole parameters, so stages 1-3 accept them;
* Muon (``needs_whole_matrices``): element-wise except its orthogonalisation, which
  :mod:`zerospeed.zero.muon_shards` runs on whole matrices;
* offload: Adam/AdamW (:data:`OFFLOADABLE_OPTIMIZERS`) run in the offload tier's CPU Adam (memory or NVMe);
  Muon and the other element-wise ones are *host-held* (:func:`host_held_optimizer`): masters and states in
  host memory (with ``device: nvme`` the states are swapped to NVMe between steps), the optimizer's own step
  run there.
"""

from __future__ import annotations

import torch

from zerospeed.ops.adam import CPUAdam

__all__ = ["ELEMENTWISE_OPTIMIZERS", "OFFLOADABLE_OPTIMIZERS", "host_held_optimizer"]

ELEMENTWISE_OPTIMIZERS = ("Adam", "AdamW", "FusedAdam", "CPUAdam", "SGD", "Adagrad", "Adamax", "RMSprop", "Adadelta",
                          "NAdam", "RAdam", "ASGD", "Rprop", "Lion")

OFFLOADABLE_OPTIMIZERS: tuple[type, ...] = (torch.optim.Adam, torch.optim.AdamW, CPUAdam)


def host_held_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Offloaded by keeping masters and states in host memory and running the optimizer's own step there."""
    if isinstance(optimizer, OFFLOADABLE_OPTIMIZERS):
        return False
    return bool(getattr(optimizer, "needs_whole_matrices", False)) or type(optimizer).__name__ in ELEMENTWISE_OPTIMIZERS
