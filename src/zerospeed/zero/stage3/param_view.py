"""DeepSpeed's ZeRO-3 parameter attributes (``ds_id``, ``ds_numel``, ``ds_shape``, ``ds_status``, ``ds_tensor``), as a view.

Transformers, PEFT, TRL and Accelerate recognise a ZeRO-3 parameter by ``hasattr(p, "ds_id")`` and read its
full size from ``p.ds_numel`` / ``p.ds_shape`` (its ``.data`` is empty between gathers), and TRL gathers only
when ``p.ds_status != ZeroParamStatus.AVAILABLE``. zerospeed keeps no such state on parameters (DESIGN.md):
when the registry (:mod:`zerospeed.zero.stage3.registry`) first maps a parameter to its bucket, the
parameter's class becomes a subclass of its own class (same ``__name__``; the object, its identity, its
module registration and the optimizer's references are unchanged) whose read-only properties look the
parameter up in the registry on every read:

* ``ds_id``: a process-wide number given in the order parameters were first partitioned (stable across the
  re-bucketing an engine does);
* ``ds_numel`` / ``ds_shape``: the whole parameter's element count and ``torch.Size``;
* ``ds_status``: ``AVAILABLE`` while its bucket is gathered and the parameter points at it, ``INFLIGHT``
  while the bucket's all-gather runs, else ``NOT_AVAILABLE``;
* ``ds_tensor``: this rank's part of the parameter, a 1-D view of the bucket's shard (zerospeed shards a
  bucket's flat run, so a rank's part of one parameter may be empty; DeepSpeed pads each parameter to an
  equal part instead). Writing into it changes the authoritative shard (not the fp32 master): use
  ``zero.GatheredParameters(..., modifier_rank=r)`` to change values.

On a parameter that is no longer partitioned (its model was handed elsewhere) every property raises
``AttributeError``, so ``hasattr(p, "ds_id")`` answers whether it is partitioned now. The registry passes
its lookup in (:func:`view_class`) so this file does not import it.
"""

from __future__ import annotations

import enum
from typing import Any, Callable

import torch
from torch import nn


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's ``deepspeed.runtime.zero.partition_parameters.ZeroParamStatus`` (same members and values)."""

    AVAILABLE = 1  # the whole parameter is in ``.data``
    NOT_AVAILABLE = 2  # partitioned: ``.data`` is empty, each rank holds its part
    INFLIGHT = 3  # the gather is under way


class ZeroParameterView:
    """Mixed in before a parameter's own class; see the module docstring. Holds no per-parameter state."""

    _zs_lookup: Callable[[Any], tuple[Any, int] | None]
    _zs_ds_id: Callable[[Any], int | None]

    def _zs_found(self, attr: str) -> tuple[Any, Any]:
        found = type(self)._zs_lookup(self)
        if found is None:
            raise AttributeError(f"{attr}: this parameter is not partitioned by ZeRO-3 (any more)")
        bucket, pos = found
        return bucket, bucket.layout.slots[pos]

    @property
    def ds_id(self) -> int:
        self._zs_found("ds_id")
        number = type(self)._zs_ds_id(self)
        if number is None:
            raise AttributeError("ds_id: this parameter is not partitioned by ZeRO-3 (any more)")
        return number

    @property
    def ds_numel(self) -> int:
        return self._zs_found("ds_numel")[1].numel

    @property
    def ds_shape(self) -> torch.Size:
        return torch.Size(self._zs_found("ds_shape")[1].shape)

    @property
    def ds_status(self) -> ZeroParamStatus:
        from zerospeed.zero.stage3.bucket import BucketState

        bucket, slot = self._zs_found("ds_status")
        if bucket.state is BucketState.INFLIGHT:
            return ZeroParamStatus.INFLIGHT
        data = self.data  # type: ignore[attr-defined]
        if bucket.state is BucketState.GATHERED and data.numel() == slot.numel and data.numel() and \
                data.data_ptr() == bucket.slot_view(bucket.layout.slots.index(slot)).data_ptr():
            return ZeroParamStatus.AVAILABLE
        if bucket.state is BucketState.GATHERED and slot.numel == 0:
            return ZeroParamStatus.AVAILABLE
        return ZeroParamStatus.NOT_AVAILABLE

    @property
    def ds_active_sub_modules(self) -> set[Any]:
        """DeepSpeed's set of the submodules using the parameter now. zerospeed counts users per bucket (the
        runtime's ``fwd_refs``), so this is a new empty set: TRL only clears it before removing the hooks."""
        self._zs_found("ds_active_sub_modules")
        return set()

    @property
    def ds_tensor(self) -> torch.Tensor:
        bucket, slot = self._zs_found("ds_tensor")
        start = max(slot.offset, bucket.shard_start)
        end = min(slot.offset + slot.numel, bucket.shard_end)
        return bucket.shard.narrow(0, start - bucket.shard_start, max(0, end - start))


_classes: dict[type, type] = {}


def view_class(cls: type, lookup: Callable[[Any], tuple[Any, int] | None],
               ds_id_of: Callable[[Any], int | None]) -> type:
    """The view subclass of parameter class ``cls`` (made once per class)."""
    if issubclass(cls, ZeroParameterView):
        return cls
    made = _classes.get(cls)
    if made is None:
        made = type(cls.__name__, (ZeroParameterView, cls), {
            "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            "_zs_lookup": staticmethod(lookup), "_zs_ds_id": staticmethod(ds_id_of)})
        _classes[cls] = made
    return made


def adopt(param: nn.Parameter, lookup: Callable[[Any], tuple[Any, int] | None],
          ds_id_of: Callable[[Any], int | None]) -> None:
    """Give ``param`` the view class of its class (its identity and everything else stay)."""
    cls = type(param)
    if issubclass(cls, ZeroParameterView) or not isinstance(param, nn.Parameter):
        return
    try:
        param.__class__ = view_class(cls, lookup, ds_id_of)
    except TypeError as exc:  # a parameter class torch will not let us subclass in place (C-level layout)
        raise TypeError(f"ZeRO-3: cannot give a {cls.__qualname__} parameter DeepSpeed's ds_* view: {exc}") from exc


def is_view(param: Any) -> bool:
    return isinstance(param, ZeroParameterView)


__all__ = ["ZeroParamStatus", "ZeroParameterView", "adopt", "is_view", "view_class"]
