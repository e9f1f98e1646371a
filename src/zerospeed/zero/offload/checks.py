"""What an offload configuration needs from the rest of the run, checked before anything is built.

Each problem is a :class:`~zerospeed.config.ConfigError` naming the key that asks for it:

* ``offload_optimizer`` needs ZeRO stage 1, 2 or 3 (stage 0 keeps full optimizer states on every
  rank; there is nothing partitioned to offload). Adam/AdamW run :mod:`zerospeed.ops.adam`'s CPU
  Adam/AdamW in the offload tier (DeepSpeed likewise swaps its ``DeepSpeedCPUAdam`` in for
  ``"type": "Adam"``); Muon and the other element-wise optimizers (SGD, Adagrad, Lion, RAdam, ...) are
  host-held (:func:`host_held_optimizer`; with ``device: nvme`` their states are swapped between steps by
  :mod:`zerospeed.zero.offload.host_held`); others (Lamb, Adafactor) are refused;
* ``offload_param`` is read at stage 3 only (only stage 3 partitions parameters); below it the section is ignored
  with a ``UserWarning`` naming it, as DeepSpeed 0.19.8 ignores it there (Accelerate's ``DeepSpeedPlugin`` writes
  it whatever the stage);
* an ``nvme`` device needs an existing, writable ``nvme_path`` (checked with a probe file, so a
  read-only mount or a full disk shows here and not in the middle of the first step).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from zerospeed.config import ConfigError
from zerospeed.ops.aio import AIOError, check_nvme_path
from zerospeed.zero.optimizer_kinds import OFFLOADABLE_OPTIMIZERS, host_held_optimizer

#: Optimizer classes whose update the offloaded step reproduces exactly (torch's Adam/AdamW math).


def check_nvme_dir(key: str, path: str) -> str:
    """``path`` as a checked directory, or a ConfigError naming ``key`` and the path."""
    try:
        return check_nvme_path(path)
    except AIOError as exc:
        raise ConfigError(key, f"{path!r}: {exc}") from exc


def check_offload(options: Any, optimizer: torch.optim.Optimizer) -> None:
    """Raise a ConfigError for an offload request this run cannot honour (see the module docstring)."""
    opt_cfg, param_cfg = options.offload_optimizer, options.offload_param
    if opt_cfg is not None:
        if options.stage not in (1, 2, 3):
            raise ConfigError("zero_optimization.offload_optimizer",
                              f"optimizer offload needs zero_optimization.stage 1, 2 or 3, got stage {options.stage}")
        # other optimizers are host-held: their own step runs on host-memory masters and states (Muon: its
        # Newton-Schulz there too, see zero/muon_shards); with nvme their states are swapped between steps
        host_held = host_held_optimizer(optimizer)
        if not isinstance(optimizer, OFFLOADABLE_OPTIMIZERS) and not host_held:
            raise ConfigError("zero_optimization.offload_optimizer",
                              f"the offloaded optimizer step is CPU Adam/AdamW; {type(optimizer).__name__} is not "
                              "supported: use optimizer.type Adam or AdamW (or torch.optim.Adam/AdamW), or remove "
                              "offload_optimizer")
        if opt_cfg.device == "nvme":
            if opt_cfg.buffer_count < 1:
                raise ConfigError("zero_optimization.offload_optimizer.buffer_count",
                                  f"{opt_cfg.buffer_count}: NVMe offload needs at least 1 swap buffer (2 or more "
                                  "overlap the reads and writes with the update)")
            check_nvme_dir("zero_optimization.offload_optimizer.nvme_path", opt_cfg.nvme_path)
    if param_cfg is not None:
        if options.stage != 3:
            warnings.warn(f"zero_optimization.offload_param is ignored at zero_optimization.stage {options.stage}: "
                          "only stage 3 offloads parameters (DeepSpeed 0.19.8 ignores it below stage 3 too)",
                          UserWarning, stacklevel=2)
            return
        if param_cfg.device == "nvme":
            check_nvme_dir("zero_optimization.offload_param.nvme_path", param_cfg.nvme_path)
