"""The action executor: runs one rank's list of schedule actions for one step.

One runtime executes any schedule (design principle 6). Per step it keeps, for each
(stage, micro-batch) this rank has started, a :class:`_Work` record: the stage input (received
tensors become leaves that require grad, so backward yields their gradient), the output or the
scaled loss, the gradient of the output once it arrives, and, for split backwards, the
:class:`~zerospeed.pipe.runtime_backward.SplitBackward` between its two halves. Records are dropped
as soon as their backward is complete, so live records are exactly the activation stash.

Action semantics (see ``schedule_action``): ``FORWARD(s, m)`` takes its input from the data
iterator (stage 0), from an earlier ``RECV_ACT(s, m)``, or, when stage ``s - 1`` runs on this rank
too (interleaving on one rank), directly from that stage's output. The last stage applies the loss
function and multiplies the loss by ``loss_scale / num_microbatches`` before its backward, which is
where DeepSpeed divides by the accumulation steps. ``BACKWARD`` accumulates parameter gradients
(bracketed by the ZeRO strategy's ``begin_backward(False)`` / ``end_backward()``: gradients only
accumulate during the step; the engine reduces them after the list) and leaves the input gradient
for ``SEND_GRAD`` or for the previous local stage. ``BACKWARD_INPUT`` / ``BACKWARD_WEIGHT`` split
it. Sends are asynchronous and all waited for at the end of the list.

The first stage reads inputs (``batch[0]``) and the last stage labels (``batch[1]``) from the
data iterator, one ``next()`` per micro-batch as DeepSpeed does; a rank that is both reads once.

Activation shapes: after the start-up handshake (``runtime_probe``) the receiver knows each
boundary's :class:`~zerospeed.pipe.p2p.ActivationMeta`; a sender checks each outgoing activation
against it and raises a clear error on a change. Modules built with ``dynamic_shape=True`` send a
header before every activation instead.

Measurements (optional, for benchmarks): ``trace`` records each action's start and end;
``measure_memory`` counts the bytes of tensors saved for backward plus the stashed stage inputs
(parameters excluded), live per step, and keeps the peak.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerospeed.pipe.p2p import P2P, ActivationMeta, as_tensors, pack_activation
from zerospeed.pipe.runtime_backward import SplitBackward, full_backward
from zerospeed.pipe.schedule_action import Action, ActionKind

__all__ = ["ActionTrace", "MicroBatchSource", "PipelineExecutor", "ShapeMismatchError"]

F, B = ActionKind.FORWARD, ActionKind.BACKWARD
I, W = ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT


class ShapeMismatchError(ValueError):
    """An activation between two stages does not have the shape/dtype agreed at start-up."""


def cast_floats(value: Any, dtype: torch.dtype, device: torch.device) -> Any:
    if torch.is_tensor(value):
        value = value.to(device)
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floats(v, dtype, device) for v in value)
    return value


class MicroBatchSource:
    """This step's micro-batches, read lazily from the data iterator and kept until the step ends."""

    def __init__(self, data_iter: Iterator[Any] | None, needs_inputs: bool, needs_labels: bool,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.data_iter = data_iter
        self.needs_inputs = needs_inputs
        self.needs_labels = needs_labels
        self.dtype = dtype
        self.device = device
        self._batches: list[tuple[Any, Any]] = []

    def _get(self, microbatch: int) -> tuple[Any, Any]:
        if self.data_iter is None:
            raise ValueError("data_iter: the first and the last pipeline stage read (inputs, labels) "
                             "micro-batches from it; this rank got None")
        while len(self._batches) <= microbatch:
            try:
                item = next(self.data_iter)
            except StopIteration:
                raise ValueError(f"data_iter: exhausted after {len(self._batches)} micro-batches; a step "
                                 "reads gradient_accumulation_steps of them") from None
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise ValueError("data_iter: must yield (inputs, labels) pairs as DeepSpeed's pipeline "
                                 f"engine expects, got {type(item).__name__}"
                                 + (f" of length {len(item)}" if isinstance(item, (tuple, list)) else ""))
            inputs, labels = item
            if isinstance(inputs, list):
                inputs = tuple(inputs)
            self._batches.append((cast_floats(inputs, self.dtype, self.device),
                                  cast_floats(labels, self.dtype, self.device)))
        return self._batches[microbatch]

    def inputs(self, microbatch: int) -> Any:
        return self._get(microbatch)[0]

    def labels(self, microbatch: int) -> Any:
        return self._get(microbatch)[1]


@dataclass
class ActionTrace:
    action: Action
    start: float
    end: float


@dataclass
class _Work:
    inputs: tuple[torch.Tensor, ...] = ()
    outputs: tuple[torch.Tensor, ...] = ()  # stage output tensors, or (scaled loss,) on the last stage
    activation: Any = None  # the output as the stage returned it (tensor or tuple)
    grad_outputs: list[torch.Tensor | None] | None = None
    input_grads: list[torch.Tensor | None] | None = None
    split: SplitBackward | None = None
    saved_bytes: int = 0


class _SavedBytes:
    """saved_tensors_hooks that add up the bytes autograd keeps for backward (parameters excluded)."""

    def __init__(self, param_storages: set[int], stashed_inputs: Sequence[torch.Tensor]) -> None:
        self.param_storages = param_storages
        self.seen = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in stashed_inputs}
        self.total = sum(nbytes for _, nbytes in self.seen)  # the stage input is kept until backward

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
        except Exception:
            return t
        if key[0] not in self.param_storages and key not in self.seen:
            self.seen.add(key)
            self.total += key[1]
        return t


class PipelineExecutor:
    """Runs action lists on this rank. ``chunks`` maps each local (virtual) stage to its module."""

    def __init__(self, chunks: Mapping[int, nn.Module], num_stages: int, rank_of_stage: Callable[[int], int],
                 loss_fn: Callable[..., Any] | None, p2p: P2P, begin_backward: Callable[[], None],
                 end_backward: Callable[[], None], dynamic_shape: bool = False) -> None:
        self.chunks = dict(chunks)
        self.num_stages = num_stages
        self.rank_of_stage = rank_of_stage
        self.loss_fn = loss_fn
        self.p2p = p2p
        self.begin_backward = begin_backward
        self.end_backward = end_backward
        self.dynamic_shape = dynamic_shape
        self.meta: dict[int, ActivationMeta] = {}  # stage s -> meta of its input (from stage s - 1)
        self.trace_enabled = False
        self.measure_memory = False
        self.trace: list[ActionTrace] = []
        self.peak_activation_bytes = 0
        self._live_bytes = 0
        self._param_storages: set[int] = set()
        self._sent_meta: dict[int, ActivationMeta] = {}

    # ------------------------------------------------------------------ public
    def run(self, actions: Sequence[Action], source: MicroBatchSource, num_microbatches: int, *,
            train: bool, loss_scale: float = 1.0, compute_loss: bool = True) -> tuple[list[torch.Tensor], list[Any]]:
        """Execute ``actions``; returns (per-micro-batch losses, per-micro-batch last-stage outputs)
        — both empty on ranks without the last stage; outputs are kept only when not training."""
        self._train = train
        self._source = source
        self._scale = loss_scale / num_microbatches
        self._compute_loss = compute_loss
        self._work: dict[tuple[int, int], _Work] = {}
        self._losses: dict[int, torch.Tensor] = {}
        self._outputs: dict[int, Any] = {}
        self.trace = []
        self._live_bytes = 0
        if self.measure_memory:
            self._param_storages = {p.untyped_storage().data_ptr() for c in self.chunks.values()
                                    for p in c.parameters()}
        handlers = {F: self._forward, B: self._backward, I: self._backward_input, W: self._backward_weight,
                    ActionKind.SEND_ACT: self._send_act, ActionKind.RECV_ACT: self._recv_act,
                    ActionKind.SEND_GRAD: self._send_grad, ActionKind.RECV_GRAD: self._recv_grad}
        clock = time.perf_counter
        try:
            for action in actions:
                if self.trace_enabled:
                    start = clock()
                    handlers[action.kind](action)
                    self.trace.append(ActionTrace(action, start, clock()))
                else:
                    handlers[action.kind](action)
            self.p2p.wait_sends()
        finally:
            self._work = {}
        losses = [self._losses[mb] for mb in sorted(self._losses)]
        outputs = [self._outputs[mb] for mb in sorted(self._outputs)]
        self._losses, self._outputs = {}, {}
        return losses, outputs

    def is_local(self, stage: int) -> bool:
        return stage in self.chunks

    # ------------------------------------------------------------------ compute
    def _get_work(self, stage: int, microbatch: int) -> _Work:
        return self._work.setdefault((stage, microbatch), _Work())

    def _forward(self, action: Action) -> None:
        s, mb = action.stage, action.microbatch
        work = self._get_work(s, mb)
        if s == 0:
            x = self._source.inputs(mb)
            inputs = tuple(t for t in (x if isinstance(x, tuple) else (x,)) if torch.is_tensor(t))
        elif self.is_local(s - 1):  # hand-over from the previous stage on this rank
            prev = self._work[(s - 1, mb)]
            inputs = tuple(self._as_input(t) for t in as_tensors(prev.activation))
            x = inputs if isinstance(prev.activation, tuple) else inputs[0]
        else:
            inputs = work.inputs
            x = pack_activation(inputs, self.meta[s])
        work.inputs = inputs
        if s > 0 and self._train:  # the stage may start with an in-place layer (ReLU(inplace=True)): it
            x = _clone_received(x)  # must not write into the leaf whose .grad is sent back upstream
        counter = _SavedBytes(self._param_storages, inputs) if self.measure_memory and self._train else None
        with torch.set_grad_enabled(self._train), (
                torch.autograd.graph.saved_tensors_hooks(counter.pack, _identity) if counter is not None
                else contextlib.nullcontext()):
            out = self.chunks[s](x)
        if s == self.num_stages - 1:
            self._finish_last_stage(work, mb, out)
        else:
            work.outputs = as_tensors(out)  # raises a clear TypeError for anything but tensors
            work.activation = out
        if counter is not None:
            work.saved_bytes = counter.total
            self._live_bytes += counter.total
            self.peak_activation_bytes = max(self.peak_activation_bytes, self._live_bytes)
        if not self._train:  # forward only: nothing is kept for a backward
            work.inputs = ()
            if s > 0 and self.is_local(s - 1):
                self._work.pop((s - 1, mb), None)
            if s == self.num_stages - 1:
                self._work.pop((s, mb), None)

    def _as_input(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if self._train and t.is_floating_point():
            t.requires_grad_(True)
        return t

    def _finish_last_stage(self, work: _Work, mb: int, out: Any) -> None:
        if not self._train and not self._compute_loss:
            self._outputs[mb] = _detach(out)
            return
        if self.loss_fn is not None:
            loss = self.loss_fn(out, self._source.labels(mb))
        else:
            loss = out
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise ValueError("loss_fn: the last stage must produce a scalar loss tensor, got "
                             + (f"a tensor of shape {tuple(loss.shape)}" if torch.is_tensor(loss)
                                else type(loss).__name__))
        self._losses[mb] = loss.detach().float().reshape(())
        if not self._train:
            self._outputs[mb] = _detach(out)
            return
        work.outputs = (loss.float().reshape(()) * self._scale,)

    def _grad_outputs(self, s: int, mb: int, work: _Work) -> list[torch.Tensor | None] | None:
        if s == self.num_stages - 1:
            return None  # seed the scaled loss with ones
        if work.grad_outputs is None:
            raise RuntimeError(f"stage {s}, micro-batch {mb}: backward before the gradient of its output arrived")
        # one received gradient per floating-point output, in order
        grads = iter(work.grad_outputs)
        return [next(grads) if t.is_floating_point() else None for t in work.outputs]

    def _backward(self, action: Action) -> None:
        s, mb = action.stage, action.microbatch
        work = self._work[(s, mb)]
        grads = self._grad_outputs(s, mb, work)
        self.begin_backward()
        try:
            input_grads = full_backward(work.outputs, grads, work.inputs)
        finally:
            self.end_backward()
        self._deliver_input_grads(s, mb, work, input_grads)
        self._retire(s, mb, work)

    def _backward_input(self, action: Action) -> None:
        s, mb = action.stage, action.microbatch
        work = self._work[(s, mb)]
        params = [p for p in self.chunks[s].parameters() if p.requires_grad]
        work.split = SplitBackward(work.outputs, self._grad_outputs(s, mb, work), work.inputs, params)
        self._deliver_input_grads(s, mb, work, work.split.input_grads())
        work.outputs, work.grad_outputs = (), None

    def _backward_weight(self, action: Action) -> None:
        s, mb = action.stage, action.microbatch
        work = self._work[(s, mb)]
        if work.split is None:
            raise RuntimeError(f"stage {s}, micro-batch {mb}: BACKWARD_WEIGHT before BACKWARD_INPUT")
        work.split.weight_grads()
        work.split = None
        self._retire(s, mb, work)

    def _deliver_input_grads(self, s: int, mb: int, work: _Work, grads: list[torch.Tensor | None]) -> None:
        if s == 0:
            return
        float_grads = [g if g is not None else torch.zeros_like(x)
                       for x, g in zip(work.inputs, grads) if x.is_floating_point()]
        if self.is_local(s - 1):
            self._work[(s - 1, mb)].grad_outputs = float_grads
        else:
            work.input_grads = float_grads

    def _retire(self, s: int, mb: int, work: _Work) -> None:
        """The backward of (s, mb) is complete: release its stash unless a send still needs it."""
        self._live_bytes -= work.saved_bytes
        work.saved_bytes = 0
        work.inputs, work.outputs, work.activation, work.grad_outputs = (), (), None, None
        if work.input_grads is None:
            self._work.pop((s, mb), None)

    # ------------------------------------------------------------------ communication
    def _send_act(self, action: Action) -> None:
        s, mb = action.stage, action.microbatch
        work = self._work[(s, mb)]
        meta = ActivationMeta.of(work.activation)
        dst = self.rank_of_stage(s + 1)
        if self.dynamic_shape:
            self.p2p.send_header(dst, meta)
        else:
            expected = self._sent_meta.get(s)
            if expected is not None and expected != meta:
                raise ShapeMismatchError(
                    f"stage {s} output changed from {expected} (agreed with stage {s + 1} at start-up) to "
                    f"{meta} at micro-batch {mb}; build the PipelineModule with dynamic_shape=True "
                    "if activation shapes vary")
        self.p2p.send_tensors(work.outputs, dst)
        if not self._train:
            self._work.pop((s, mb), None)

    def _recv_act(self, action: Action) -> None:
        s, mb = action.stage, action.microbatch
        src = self.rank_of_stage(s - 1)
        if self.dynamic_shape:
            header = self.p2p.recv_header(src)
            if isinstance(header, str):
                raise RuntimeError(header)
            self.meta[s] = header
        meta = self.meta[s]
        tensors = self.p2p.recv_tensors(meta.tensors, src)
        self._get_work(s, mb).inputs = tuple(self._as_input(t) for t in tensors)

    def _send_grad(self, action: Action) -> None:
        s, mb = action.stage, action.microbatch
        work = self._work[(s, mb)]
        assert work.input_grads is not None
        self.p2p.send_tensors(work.input_grads, self.rank_of_stage(s - 1))
        work.input_grads = None
        if not work.inputs and not work.outputs and work.split is None:
            self._work.pop((s, mb), None)

    def _recv_grad(self, action: Action) -> None:
        s, mb = action.stage, action.microbatch
        work = self._work[(s, mb)]
        metas = ActivationMeta.of(work.activation).grad_metas if work.activation is not None else ()
        work.grad_outputs = self.p2p.recv_tensors(metas, self.rank_of_stage(s + 1))

    # ------------------------------------------------------------------ shapes
    def set_sent_meta(self, sent: Mapping[int, ActivationMeta]) -> None:
        """Metadata of each local stage's output, as agreed at start-up (checked on every send)."""
        self._sent_meta = dict(sent)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _detach(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return type(value)(_detach(v) for v in value)
    return value


def _clone_received(x: Any) -> Any:
    """``x`` with each grad-requiring tensor replaced by a clone (autograd passes the gradient
    through to the received leaf). Costs one copy of the stage's input per micro-batch."""
    if torch.is_tensor(x):
        return x.clone() if x.requires_grad else x
    if isinstance(x, tuple):
        return tuple(_clone_received(t) for t in x)
    return x
