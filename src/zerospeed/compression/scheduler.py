"""``CompressionScheduler``: the global step counter that drives every compressed layer's schedule.

The engine calls :meth:`step` once per optimizer step (see ``runtime/engine.py``); a user training
without the engine calls it after ``optimizer.step()``.  Before the first step the layers are set for
step 0, so ``schedule_offset: 0`` compresses from the first forward.

Data-parallel replication: state that depends on the data (static activation ranges, snip_momentum
scores) differs between ranks, so :meth:`step` averages it over ``dp_group`` (through
:mod:`zerospeed.comm`, one all-reduce of one flat tensor) before the next masks are computed.  Masks
themselves are computed from the full (ZeRO-3: gathered) weight, identical on every rank.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from zerospeed import comm

from .layers import CompressedLayer

_SCHEDULERS: "weakref.WeakKeyDictionary[nn.Module, CompressionScheduler]" = weakref.WeakKeyDictionary()


class CompressionScheduler:
    def __init__(self, model: nn.Module, layers: dict[str, CompressedLayer], config: Any = None) -> None:
        self.layers = layers
        self.config = config  # the parsed compression_training section (re-applied after a tp split)
        self.training_steps = 0
        self._apply()
        _SCHEDULERS[model] = self

    def _apply(self) -> None:
        for layer in self.layers.values():
            layer.set_step(self.training_steps)

    def _buffers(self, name: str) -> list[torch.Tensor]:
        return [b for layer in self.layers.values() if isinstance(b := getattr(layer, name, None), torch.Tensor)]

    @staticmethod
    def _reduce(tensors: list[torch.Tensor], op: Any, dp_group: Any, mean: bool = False) -> None:
        """One all-reduce of ``tensors`` flattened together, written back in place."""
        if not tensors or not comm.is_initialized() or comm.get_world_size(dp_group) == 1:
            return
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        comm.all_reduce(flat, op=op, group=dp_group)
        if mean:
            flat /= comm.get_world_size(dp_group)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()

    @torch.no_grad()
    def step(self, dp_group: Any = None) -> None:
        """Advance one optimizer step: make rank-local state global over ``dp_group``, then re-schedule.

        Static activation ranges: this step's min and max are reduced with MIN / MAX (so the range is
        the whole global batch's, the same at any data-parallel size), then folded into the EMA.
        snip_momentum scores are averaged (replicated, not world-size invariant: |w * g| of a shard's
        gradient is not linear in the batch).
        """
        self.training_steps += 1
        self._reduce(self._buffers("act_batch_low"), comm.ReduceOp.MIN, dp_group)
        self._reduce(self._buffers("act_batch_high"), comm.ReduceOp.MAX, dp_group)
        for layer in self.layers.values():
            if layer.aq is not None and layer.aq.static:
                layer.fold_activation_range()
        self._reduce(self._buffers("sparse_snip_score"), comm.ReduceOp.SUM, dp_group, mean=True)
        for layer in self.layers.values():
            layer.sync_tp_state()
        self._apply()

    def state_dict(self) -> dict[str, int]:
        return {"training_steps": self.training_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.training_steps = int(state["training_steps"])
        self._apply()


def scheduler_of(model: nn.Module) -> CompressionScheduler | None:
    """The scheduler :func:`~zerospeed.compression.init_compression` attached to ``model``, if any."""
    return _SCHEDULERS.get(model)


def compression_scheduler_for(model: nn.Module, config: Any) -> CompressionScheduler | None:
    """The engine's hook: the scheduler of ``model`` when ``config`` enables compression_training.

    Raises if the config enables compression but :func:`init_compression` was not applied, because
    training the uncompressed model would silently ignore the section.
    """
    section = getattr(config, "compression_training", None)
    if section is None or not section.any_enabled:
        return None
    from zerospeed.config import ConfigError

    # the model itself, or (pipeline: the engine's container) the module init_compression was given
    found = [s for m in model.modules() if (s := scheduler_of(m)) is not None]
    if not found:
        raise ConfigError("compression_training", "is enabled but the model was not compressed: call "
                          "zerospeed.compression.init_compression(model, config) before initialize()")
    if len(found) > 1:
        raise ValueError("compression: init_compression was applied to several parts of this model; apply it "
                         "once, to the model given to initialize()")
    return found[0]
