"""``loss.backward()`` on the engine's output, as DeepSpeed allows it, exact where it can be.

``engine.backward(loss)`` scales the loss by ``loss_scale / gradient_accumulation_steps`` and
brackets the backward pass with the ZeRO strategy's ``begin_backward(boundary)`` /
``end_backward()``. A plain ``loss.backward()`` does neither, so the engine's ``forward`` passes its
floating outputs through an identity autograd function (:class:`_Entry`). Its backward runs before
any of the module's backward (it is the last node of the forward graph), and when the pass was not
started by ``engine.backward`` it:

* calls ``begin_backward`` and queues ``end_backward`` to run when the autograd pass finishes;
* multiplies the gradients of the outputs by ``1 / gradient_accumulation_steps`` (DeepSpeed does
  the same, per output tensor), and by the loss scale under fp16.

By linearity this equals scaling the loss, so gradients match ``engine.backward`` up to rounding
(the parity test states the tolerance). Where it cannot be exact the hook refuses with an error:

* fp16 with a loss scale other than 1 and an output that is not the loss itself (a non-scalar
  output such as logits): the gradient arriving at an fp16 output is computed *unscaled* by the
  loss function's backward and may already have underflowed; scaling it afterwards cannot restore
  it. The error names ``engine.backward(loss)`` and ``engine.scale(loss).backward()`` (DeepSpeed's
  own manual form: ``scale`` multiplies by the loss scale, the hook then only divides by the
  accumulation steps). When the model returns the scalar loss (HuggingFace style) the scaling is
  exact and allowed.

Under a torch.func transform (``torch.func.grad(lambda x: engine(x))``, ``vmap``, ``jacrev``, ``jvp``)
the gradients pass through :class:`_Entry` untouched and the strategy's hooks are not called, as in
DeepSpeed: the transform differentiates a function, it is not a training step.

Not detected (as in DeepSpeed): loss terms that use parameters directly, outside the engine's
forward (``loss = ce(engine(x), y) + l2(model.weight)``), are not divided by the accumulation steps
under ``loss.backward()``; use ``engine.backward`` for such losses.
"""

from __future__ import annotations

from typing import Any

import torch

_LOW_PRECISION = (torch.float16,)


def functorch_transforming() -> bool:
    """True under a torch.func transform (grad, vmap, jacrev, jvp, ...), as DeepSpeed checks it."""
    functorch = getattr(torch._C, "_functorch", None)
    peek = getattr(functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


class _Entry(torch.autograd.Function):
    """Identity on the engine's outputs; its backward hands their gradients to :class:`TorchBackwardHooks`.

    ``forward`` + ``setup_context`` (not ``forward(ctx, ...)``) and ``generate_vmap_rule`` make it usable
    under torch.func transforms. There, as in DeepSpeed, the gradients pass through untouched: the
    transform computes gradients of a function, not a training step (no accumulation-step division, no
    loss scale, no ``begin_backward`` / ``end_backward``).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(hooks: "TorchBackwardHooks", *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # detach(), not view_as(): the outputs may then be modified in place (HF Trainer: `loss *= ...`),
        # which autograd forbids on views made inside a custom Function; the version counter is shared
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.hooks = inputs[0]
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        if functorch_transforming():
            return (None, *grads)
        return (None, *ctx.hooks.on_output_grads(grads))

    @staticmethod
    def jvp(ctx: Any, _hooks_tangent: Any, *tangents: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return tangents


def _leaves(obj: Any, out: list[torch.Tensor]) -> None:
    if torch.is_tensor(obj):
        if obj.requires_grad and obj.is_floating_point():
            out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _leaves(v, out)
    elif isinstance(obj, dict):
        for v in obj.values():
            _leaves(v, out)


def _replace(obj: Any, mapping: dict[int, torch.Tensor]) -> Any:
    if torch.is_tensor(obj):
        return mapping.get(id(obj), obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_replace(v, mapping) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_replace(v, mapping) for v in obj)
    if isinstance(obj, dict):
        for k in list(obj.keys()):  # in place: keeps dict subclasses (HF ModelOutput) as they are
            obj[k] = _replace(obj[k], mapping)
        return obj
    return obj


class TorchBackwardHooks:
    """The engine side of a user-called ``loss.backward()`` (one per engine)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.engine_backward_active = False  # engine.backward is running: pass gradients through
        self.user_scaled = False  # engine.scale(loss) was called for the next backward
        self._pass_active = False

    def attach(self, output: Any) -> Any:
        """``output`` with its floating, grad-requiring tensors routed through :class:`_Entry`."""
        if not torch.is_grad_enabled():
            return output
        tensors: list[torch.Tensor] = []
        _leaves(output, tensors)
        if not tensors:
            return output
        unique = list({id(t): t for t in tensors}.values())
        routed = _Entry.apply(self, *unique)
        return _replace(output, {id(t): r for t, r in zip(unique, routed)})

    def expect_user_scaled(self) -> None:
        self.user_scaled = True

    def on_output_grads(self, grads: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
        if self.engine_backward_active:
            return grads
        engine = self.engine
        if not self._pass_active:
            self._pass_active = True
            engine.strategy.begin_backward(engine._reduces_in_backward())
            torch.autograd.Variable._execution_engine.queue_callback(self._end_pass)
        loss_scale = 1.0 if self.user_scaled else float(engine.loss_scaler.scale)
        if loss_scale != 1.0:
            for g in grads:
                if g is not None and g.numel() != 1 and g.dtype in _LOW_PRECISION:
                    self._end_pass()
                    raise RuntimeError(
                        "loss.backward() under fp16 loss scaling is exact only when the model returns the scalar "
                        f"loss (an output of shape {tuple(g.shape)} got an unscaled fp16 gradient that may have "
                        "underflowed); call engine.backward(loss) or engine.scale(loss).backward()")
        factor = loss_scale / engine.gradient_accumulation_steps()
        if factor == 1.0:
            return grads
        return tuple(None if g is None else g * factor for g in grads)

    def _end_pass(self) -> None:
        if not self._pass_active:
            return
        self._pass_active = False
        self.user_scaled = False
        self.engine.strategy.end_backward()
