"""``checkpoint(function, *args)``: run ``function`` without keeping its activations, recompute
them in the backward (DeepSpeed's ``deepspeed.checkpointing.checkpoint``).

Decisions:

* Two schemes, picked per call:
  - torch's non-reentrant checkpoint (``torch.utils.checkpoint.checkpoint(use_reentrant=False)``)
    by default: it keeps the inputs, works with ``torch.autograd.grad`` (the pipeline's zero-bubble
    split backward), with inputs that need no gradient, and with torch's selective policies
    (``context_fn``, used when a policy is configured);
  - an autograd Function (the reentrant scheme of DeepSpeed and Megatron) when
    ``partition_activations`` or ``cpu_checkpointing`` is on, because then *we* must hold the inputs
    (:class:`~zerospeed.checkpointing.storage.InputStore`: partitioned over TP ranks, or in host
    memory). Its forward runs under ``no_grad``; its backward restores the forward's RNG states
    (CPU, CUDA and the TP tracker: dropout draws the same masks), recomputes with gradients on and
    back-propagates through the recomputed graph. It needs a tensor input that requires grad (else
    autograd never calls its backward): without one the call falls back to the first scheme.
* Both recompute module forwards inside the backward, so ZeRO-3's forward hooks gather the
  parameters again, and parameter gradients reach ZeRO's gradient hooks as usual.
* Under ``torch.no_grad()`` the function simply runs: nothing would be saved anyway.
* Keyword arguments are not part of DeepSpeed's signature; non-tensor positional arguments pass
  through. Outputs may be a tensor or a tuple (non-tensor entries pass through).
* ``synchronize`` synchronises the device at each checkpoint boundary (forward and recompute);
  ``profile`` accumulates forward and recompute wall times in :func:`profile_stats` (reentrant
  scheme).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from zerospeed.checkpointing import settings as settings_mod
from zerospeed.checkpointing.rng import capture_rng_states, restored_rng_states
from zerospeed.checkpointing.measure import note_kept
from zerospeed.checkpointing.selective import context_fn
from zerospeed.checkpointing.storage import InputStore

_STATS = {"forward_s": 0.0, "recompute_s": 0.0, "num_forward": 0, "num_recompute": 0}


def profile_stats() -> dict[str, float]:
    """Forward and recompute wall times of checkpoints run with ``profile`` on (since the last reset)."""
    return dict(_STATS)


def reset_profile_stats() -> None:
    _STATS.update(forward_s=0.0, recompute_s=0.0, num_forward=0, num_recompute=0)


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(settings: Any, key: str, device: torch.device | None) -> Any:
    class _Timer:
        def __enter__(self) -> None:
            if settings.synchronize:
                _sync(device)
            self.t0 = time.perf_counter()

        def __exit__(self, *exc: Any) -> None:
            if settings.synchronize or settings.profile:
                _sync(device)
            if settings.profile:
                _STATS[f"{key}_s"] += time.perf_counter() - self.t0
                _STATS[f"num_{key}"] += 1

    return _Timer()


class CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, run_function: Callable[..., Any], settings: Any, *args: Any) -> Any:
        ctx.run_function = run_function
        ctx.settings = settings
        ctx.rng_states = capture_rng_states()
        tensor_positions = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.tensor_positions = tensor_positions
        ctx.inputs_need_grad = [args[i].requires_grad for i in tensor_positions]
        ctx.others = [a if not torch.is_tensor(a) else None for a in args]
        device = next((args[i].device for i in tensor_positions), None)
        ctx.device = device
        with _timed(settings, "forward", device), torch.no_grad():
            outputs = run_function(*args)
        store = InputStore(settings, settings_mod.tp_group_and_size() if settings.partition_activations
                           else (None, 1, 0))
        ctx.save_for_backward(*store.pack([args[i] for i in tensor_positions]))
        ctx.store = store
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("zerospeed.checkpointing: checkpointed backward is not compatible with "
                               "torch.autograd.grad(); use .backward()")
        tensors = ctx.store.unpack(ctx.saved_tensors)
        args = list(ctx.others)
        for pos, t, needs in zip(ctx.tensor_positions, tensors, ctx.inputs_need_grad):
            args[pos] = t.detach().requires_grad_(needs)
        with _timed(ctx.settings, "recompute", ctx.device), restored_rng_states(ctx.rng_states), \
                torch.enable_grad():
            outputs = ctx.run_function(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads)
                 if torch.is_tensor(o) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = [a.grad if torch.is_tensor(a) else None for a in args]
        return (None, None, *input_grads)


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """Run ``function(*args)`` keeping only its inputs; recompute in the backward (see module doc)."""
    if not callable(function):
        raise TypeError(f"checkpoint: function must be callable, got {type(function).__name__}")
    if not torch.is_grad_enabled():
        return function(*args)
    settings = settings_mod.current()
    holds_inputs = settings.partition_activations or settings.cpu_checkpointing
    if holds_inputs and any(torch.is_tensor(a) and a.requires_grad for a in args):
        return CheckpointFunction.apply(function, settings, *args)
    return non_reentrant_checkpoint(function, *args)


def non_reentrant_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """DeepSpeed's name for the non-reentrant variant: torch's, with the configured selective policy."""
    if not callable(function):
        raise TypeError(f"non_reentrant_checkpoint: function must be callable, got {type(function).__name__}")
    note_kept([a for a in args if torch.is_tensor(a)])  # what torch's checkpoint holds until the backward
    policy = settings_mod.current().policy
    if policy is not None:
        return torch_checkpoint(function, *args, use_reentrant=False, context_fn=context_fn(policy))
    return torch_checkpoint(function, *args, use_reentrant=False)
