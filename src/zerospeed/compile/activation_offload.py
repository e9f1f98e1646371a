"""Activation offload (``compile.offload_activation: true``): large tensors the forward graph saves
for the backward graph wait in host memory instead of device memory.

Decisions:

* It is a partition-time pass (:func:`offload_activations`, run by ``backend_fn`` right after the
  min-cut partitioner) because it must rewrite both graphs consistently: a saved tensor is a
  forward output whose name is a backward placeholder. Each saved tensor of at least
  ``threshold_bytes`` (``compile.free_activation_threshold``) that the forward computed (not a graph
  input, not a gathered ZeRO-3 parameter: selective unsharding decides about those) gets a
  ``zerospeed::offload`` right after its last use in the forward; the forward saves the op's empty
  token instead, so the device copy is freed as soon as the forward is done with it. In the
  backward, a ``zerospeed::reload`` of the same slot goes right before the first use. A saved tensor
  with a dynamic (symbolic) size stays: the reload's size would have to be computed in the graph.
* The copies are synchronous on CPU (host memory is the memory the tensor is in: the pass then only
  costs the copies; it exists there for parity tests and for the same graphs on accelerators). On
  an accelerator the host copy is pinned and both copies are issued ``non_blocking`` on the current
  stream, which orders them with the kernels around them.
* :class:`ActivationStore` holds the host copies, one stack per slot: a forward that runs twice
  before the backwards (two micro-batches, then both backwards) reloads in reverse order, as
  autograd runs the backwards. A reload with nothing stored is an error naming the slot.
"""

from __future__ import annotations

import itertools

import torch
from torch.fx import GraphModule, Node

from .ops import GATHER, GATHER_WAIT, OFFLOAD, RELOAD

__all__ = ["ActivationStore", "offload_activations"]


class ActivationStore:
    """Host copies of offloaded activations, by slot."""

    def __init__(self) -> None:
        self.stacks: dict[int, list[torch.Tensor]] = {}
        self.slots = itertools.count()
        self.counts = {"offloaded": 0, "reloaded": 0, "offloaded_bytes": 0}

    def new_slot(self) -> int:
        return next(self.slots)

    def offload(self, t: torch.Tensor, slot: int) -> None:
        t = t.detach()
        if t.device.type == "cpu":
            host = t.contiguous().clone()
        else:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
        self.stacks.setdefault(slot, []).append(host)
        self.counts["offloaded"] += 1
        self.counts["offloaded_bytes"] += host.numel() * host.element_size()

    def reload(self, slot: int, device: torch.device) -> torch.Tensor:
        stack = self.stacks.get(slot)
        if not stack:
            raise RuntimeError(f"activation offload: nothing stored for slot {slot} (a backward without its forward?)")
        host = stack.pop()
        self.counts["reloaded"] += 1
        if device.type == "cpu":
            return host
        return host.to(device, non_blocking=True)

    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for stack in self.stacks.values() for t in stack)


def _is_parameter(n: Node) -> bool:
    """``n`` is a gathered ZeRO-3 bucket or a view of one."""
    while n.op == "call_function":
        if n.target in (GATHER, GATHER_WAIT):
            return True
        if not getattr(n.target, "is_view", False) or not n.args or not isinstance(n.args[0], Node):
            return False
        n = n.args[0]
    return False


def offload_activations(fw: GraphModule, bw: GraphModule, store: ActivationStore, key: int,
                        threshold_bytes: int) -> list[str]:
    """Rewrite the saved tensors of at least ``threshold_bytes`` (see the module docstring); returns
    the names of the offloaded tensors."""
    out = next(n for n in fw.graph.nodes if n.op == "output")
    outputs = list(out.args[0])
    # the forward's outputs end with what it saves, in the order of the backward's first placeholders
    saved = [n for n in bw.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]
    first_saved = len(outputs) - len(saved)
    if first_saved < 0 or any(not isinstance(v, Node) or v.name != p.name
                              for v, p in zip(outputs[first_saved:], saved)):
        return []  # (not the layout aot_autograd produces: nothing is rewritten)
    placeholders = {p.name: p for p in saved}
    fw_order = {n: i for i, n in enumerate(fw.graph.nodes)}
    bw_order = {n: i for i, n in enumerate(bw.graph.nodes)}
    done: list[str] = []
    for i in range(first_saved, len(outputs)):
        v = outputs[i]
        if v.op != "call_function" or _is_parameter(v):
            continue
        val = v.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.numel() * val.element_size() < threshold_bytes:
            continue
        if any(not isinstance(d, int) for d in val.shape):
            continue  # (a dynamic shape: the reload's size is not a constant of the graph)
        ph = placeholders[v.name]
        if not ph.users:
            continue
        slot = store.new_slot()
        readers = [u for u in v.users if u is not out and u.target is not OFFLOAD]
        anchor = max(readers, key=fw_order.__getitem__) if readers else v
        with fw.graph.inserting_after(anchor):
            token = fw.graph.call_function(OFFLOAD, (v, key, slot))
        token.meta["val"] = val.new_empty(0)
        outputs[i] = token
        first = min(ph.users, key=bw_order.__getitem__)
        with bw.graph.inserting_before(first):
            back = bw.graph.call_function(RELOAD, (ph, key, slot, list(val.shape), val.dtype))
        back.meta["val"] = val.new_empty(val.shape)
        ph.replace_all_uses_with(back, delete_user_cb=lambda u: u is not back)
        ph.meta["val"] = val.new_empty(0)
        done.append(v.name)
    out.args = (tuple(outputs),) if isinstance(out.args[0], tuple) else (outputs,)
    for gm in (fw, bw):
        gm.graph.lint()
        gm.recompile()
    return done
