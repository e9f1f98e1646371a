"""Muon with an auxiliary Adam: DeepSpeed's ``optimizer.type: "Muon"``.

Muon (MomentUm Orthogonalized by Newton-Schulz) runs SGD-momentum on 2-D hidden weights and replaces
each matrix's update by an approximately orthogonal one; every other parameter (embeddings, the LM head,
norms, biases) is trained by an Adam inside the same optimizer. Facts followed here, from DeepSpeed
0.19.8 (``runtime/zero/muon/original_muon.py``, ``runtime/engine.py`` ``_muon_param_groups``,
``deepspeed/__init__.py`` ``set_optimizer_flags``):

* tagging: a parameter is on Muon when its shape has >= 2 dimensions and its name contains neither
  ``embed`` nor ``lm_head`` (case-insensitive); everything else is on the Adam half. Overridable per
  parameter: a ``use_muon`` key in a parameter-group dict, or a ``use_muon`` attribute the user set on the
  parameter (DeepSpeed's spelling; zerospeed only reads it, never sets it);
* settings per half: Muon takes ``lr``, ``momentum``, ``weight_decay``, ``ns_method``; Adam takes ``lr``,
  ``betas``, ``eps``, ``weight_decay``. ``muon_lr`` / ``adam_lr`` override the shared ``lr``; a group's
  own keys override both. Defaults (MuonWithAuxAdam): Muon lr 0.02, momentum 0.95, weight_decay 0,
  ns_method ``gram``; Adam lr 3e-4, betas (0.9, 0.95), eps 1e-10, weight_decay 0;
* the Muon update of a matrix G with momentum buffer M (beta = momentum)::

      M <- lerp(M, G, 1 - beta)             # M = beta*M + (1-beta)*G
      U <- lerp(G, M, beta)                 # nesterov: (1-beta)*G + beta*M
      O <- NS5(U) * sqrt(max(1, rows/cols))
      W <- W * (1 - lr*wd) - lr * O         # decoupled weight decay

  NS5 is the quintic Newton-Schulz iteration, coefficients (a, b, c) = (3.4445, -4.7750, 2.0315),
  5 steps, on the wide orientation (transpose when rows > cols), after dividing by the Frobenius
  norm + 1e-7. ``ns_method: "gram"`` iterates on the Gram matrix X X^T with a restart at step 2
  (Tri Dao's Gram Newton-Schulz, mathematically the same map); square matrices use the standard
  iteration. A conv weight (4-D) is viewed as ``(out, in*kh*kw)``; its scale reads the last two dims,
  as DeepSpeed's does;
* the Adam half is DeepSpeed's inline ``adam_update``: ``m.lerp_(g, 1-b1)``, ``v.lerp_(g*g, 1-b2)``,
  ``u = (m/(1-b1^t)) / (sqrt(v/(1-b2^t)) + eps)``, then ``W <- W*(1 - lr*wd) - lr*u``
  (``adam_w_mode: false``: ``g + wd*W`` instead of the decoupled decay).

Where zerospeed differs, on purpose: the Newton-Schulz iteration runs in fp32 on every device
(DeepSpeed casts to bf16 for ``standard`` and fp16 for ``gram`` where the accelerator has them), so a
step is reproducible across devices and shardings; the overflow guard on the momentum is the engine's
overflow skip (the optimizer is not stepped on a non-finite gradient). ``ns_dtype: "bfloat16"`` (zerospeed's key,
per Muon group) iterates in bf16 after the fp32 normalisation: DeepSpeed's dtype for ``standard`` on a bf16
device, about 2-3x faster on a CPU with bf16 matrix units (measured: bench/optim_bench.py), a few percent away
from the fp32 result; DeepSpeed's fp16 for ``gram`` is not offered (a CPU without fp16 matmuls, such as the
bench machine, runs it in fp32 in DeepSpeed too, which is zerospeed's default).

``variant: "torch"`` gives torch.optim.Muon's matrix update instead (torch 2.13 ``torch/optim/_muon.py``).
It has the same momentum and nesterov blend and the same ``sqrt(max(1, rows/cols))`` factor (torch puts
it in the lr, ``adjust_lr_fn="original"``; weight decay uses the unadjusted lr in both), and differs in:
the Newton-Schulz normalisation ``X / max(||X||, 1e-7)`` (DeepSpeed: ``X / (||X|| + 1e-7)``), the standard
iteration always (no Gram variant: ``ns_method`` is ignored), bf16 arithmetic in torch (fp32 here), 2-D
parameters only in torch, and torch's defaults (lr 1e-3, weight_decay 0.1) where DeepSpeed's are lr 0.02,
weight_decay 0 - zerospeed keeps DeepSpeed's defaults for both variants.

Sharding: the element-wise parts (momentum, nesterov blend, decay, Adam) run on whatever tensor the
optimizer holds, a whole parameter or a flat ZeRO shard. The orthogonalisation needs whole matrices;
for a flat shard, ZeRO binds an *orthogonaliser* (:meth:`Muon.bind_orthogonalizer`, see
:mod:`zerospeed.zero.muon_shards`) that returns this rank's piece of ``NS(U) * scale`` for the bucket;
at ZeRO-0 with more than one rank it binds one per bucket too, so that each matrix is orthogonalised by
one rank and the results all-reduced, instead of every rank repeating every matrix.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Mapping

import torch

__all__ = ["Muon", "NS_METHODS", "VARIANTS", "newton_schulz", "muon_scale", "ns_flops", "tag_use_muon",
           "MUON_DEFAULTS", "ADAM_DEFAULTS", "orthogonalized_update"]

NS_METHODS = ("gram", "standard")
#: the dtype Newton-Schulz iterates in (``ns_dtype``, zerospeed's key): fp32 by default; bf16 is DeepSpeed's choice
#: for ``standard`` on an accelerator with bf16 (it picks fp16 for ``gram``, fp32 where fp16 is missing, as on CPUs)
NS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
VARIANTS = ("deepspeed", "torch")
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
MUON_DEFAULTS: dict[str, Any] = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram",
                                 "ns_dtype": "float32"}
ADAM_DEFAULTS: dict[str, Any] = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}
MUON_KEYS = ("lr", "momentum", "weight_decay", "ns_method", "ns_dtype")
ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")


def _matrix(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The 2-D view Muon orthogonalises: ``(shape[0], prod(shape[1:]))``."""
    return t.reshape(shape[0], -1)


def muon_scale(shape: tuple[int, ...]) -> float:
    """DeepSpeed's shape-dependent scale ``sqrt(max(1, rows/cols))`` on the last two dims."""
    rows, cols = shape[-2], shape[-1]
    return math.sqrt(rows / cols) if rows > cols else 1.0


def _standard(x: torch.Tensor, steps: int) -> torch.Tensor:
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        s = x @ x.mT
        x = a * x + (b * s + c * s @ s) @ x
    return x


def _gram(x: torch.Tensor, steps: int) -> torch.Tensor:
    """Gram Newton-Schulz on a wide ``x`` (n <= m), restart at iteration 2 (as DeepSpeed's)."""
    a, b, c = NS_COEFFICIENTS
    r = x @ x.mT
    q: torch.Tensor | None = None
    restart_at = 2
    for i in range(steps):
        if i == restart_at:
            assert q is not None
            x = q @ x
            r = x @ x.mT
            q = None
        z = b * r + c * r @ r
        if q is None:
            q = z.clone()
            q.diagonal().add_(a)
        else:
            q = a * q + z @ q
        if i < steps - 1 and (i + 1) != restart_at:
            rz = a * r + z @ r
            r = a * rz + z @ rz
    assert q is not None
    return q @ x


def newton_schulz(g: torch.Tensor, method: str = "gram", steps: int = NS_STEPS, variant: str = "deepspeed",
                  dtype: str = "float32") -> torch.Tensor:
    """Approximate orthogonalisation of the 2-D ``g`` (fp32 result, same shape). The normalisation is in fp32, the
    iteration in ``dtype`` (a key of :data:`NS_DTYPES`)."""
    x = g.to(torch.float32)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.mT
    if variant == "torch":
        x = x / x.norm().clamp(min=1e-7)
    else:
        x = x / (x.norm() + 1e-7)
    x = x.to(NS_DTYPES[dtype])
    if method == "gram" and x.size(1) > x.size(0) and variant != "torch":
        x = _gram(x, steps)
    else:
        x = _standard(x, steps)
    x = x.to(torch.float32)
    return x.mT if tall else x


def ns_flops(shape: tuple[int, ...], method: str = "gram", steps: int = NS_STEPS) -> int:
    """Multiply-add FLOPs (2 per MAC) of one Newton-Schulz orthogonalisation of a ``shape`` matrix."""
    rows = shape[0]
    cols = 1
    for d in shape[1:]:
        cols *= d
    n, m = min(rows, cols), max(rows, cols)
    if method == "gram" and m > n:
        # R = X X^T (n^2 m), then per step Z (n^3), Q update (n^3, not the first), R update (2 n^3,
        # not the last nor before the restart), the restart's X <- QX and R (2 n^2 m), final QX (n^2 m)
        macs = n * n * m + steps * n ** 3 + (steps - 2) * n ** 3 + (steps - 2) * 2 * n ** 3 + 3 * n * n * m
        return 2 * macs
    return 2 * steps * (2 * n * n * m + n ** 3)


def orthogonalized_update(u: torch.Tensor, shape: tuple[int, ...], method: str, variant: str = "deepspeed",
                          dtype: str = "float32") -> torch.Tensor:
    """``NS(U) * scale`` for one matrix (torch's variant scales the lr instead: the same product)."""
    o = newton_schulz(_matrix(u, shape), method, variant=variant, dtype=dtype) * muon_scale(shape)
    return o.reshape(u.shape).to(u.dtype)


def _use_muon_by_name(name: str, shape: tuple[int, ...]) -> bool:
    lowered = name.lower()
    return len(shape) >= 2 and "embed" not in lowered and "lm_head" not in lowered


def tag_use_muon(groups: list[dict[str, Any]], names: Mapping[int, str],
                 shapes: Mapping[int, tuple[int, ...]] | None = None) -> list[list[bool]]:
    """Per group, per parameter: on Muon? The most specific answer wins: a ``use_muon`` attribute the
    user set on the parameter, then the group's ``use_muon`` key, then DeepSpeed's name/shape rule.

    ``shapes`` gives the layer shape where a parameter's own shape is not it (zero.Init's empty
    placeholders); by default ``p.shape``.
    """
    out = []
    for g in groups:
        flags = []
        for p in g["params"]:
            own = getattr(p, "use_muon", None)
            if own is not None:
                flags.append(bool(own))
            elif "use_muon" in g:
                flags.append(bool(g["use_muon"]))
            else:
                shape = tuple((shapes or {}).get(id(p), tuple(p.shape)))
                flags.append(_use_muon_by_name(names.get(id(p), ""), shape))
        out.append(flags)
    return out


#: (the unit's updates, the param group) -> NS(U) * scale for each of the unit's tensors (this rank's piece)
Orthogonalizer = Callable[[list[torch.Tensor], Mapping[str, Any]], list[torch.Tensor]]


class Muon(torch.optim.Optimizer):
    """Muon on the groups with ``use_muon: True``, DeepSpeed's inline Adam on the others.

    Each group must carry ``use_muon``; Muon groups carry ``lr``, ``momentum``, ``weight_decay``,
    ``ns_method``; Adam groups ``lr``, ``betas``, ``eps``, ``weight_decay`` (missing ones take
    :data:`MUON_DEFAULTS` / :data:`ADAM_DEFAULTS`). State: ``momentum_buffer`` per Muon tensor;
    ``exp_avg``, ``exp_avg_sq``, ``step`` per Adam tensor (torch's Adam names, so checkpoints reshard
    them the same way).
    """

    #: ZeRO may hand this optimizer flat shards: it binds an orthogonaliser for each Muon shard
    needs_whole_matrices = True

    def __init__(self, param_groups: Iterable[dict[str, Any]], adam_w_mode: bool = True,
                 variant: str = "deepspeed") -> None:
        groups = []
        for g in param_groups:
            g = dict(g)
            if "use_muon" not in g:
                raise ValueError("every Muon parameter group needs a 'use_muon' key")
            defaults = MUON_DEFAULTS if g["use_muon"] else ADAM_DEFAULTS
            for k, v in defaults.items():
                g.setdefault(k, v)
            if g["use_muon"] and g["ns_method"] not in NS_METHODS:
                raise ValueError(f"ns_method {g['ns_method']!r} is not one of {', '.join(NS_METHODS)}")
            if g["use_muon"] and g["ns_dtype"] not in NS_DTYPES:
                raise ValueError(f"ns_dtype {g['ns_dtype']!r} is not one of {', '.join(NS_DTYPES)}")
            if not g["use_muon"]:
                g["betas"] = tuple(g["betas"])
            groups.append(g)
        if variant not in VARIANTS:
            raise ValueError(f"variant {variant!r} is not one of {', '.join(VARIANTS)}")
        super().__init__(groups, {})
        self.adam_w_mode = adam_w_mode
        self.variant = variant
        #: id(tensor) -> (the tensors of its unit, their orthogonaliser); set by ZeRO, one unit per bucket
        self._unit_of: dict[int, tuple[list[torch.Tensor], Orthogonalizer]] = {}
        #: the object ZeRO bound (owner plan, per-rank FLOP counter); None when not sharded
        self.shard_plan: Any = None

    def bind_orthogonalizer(self, tensors: list[torch.Tensor], fn: Orthogonalizer) -> None:
        """Use ``fn(updates, group)`` (one update per tensor, in order; returns ``NS(U) * scale`` for each)
        instead of a whole-matrix NS per tensor: ZeRO binds one unit per bucket, either its flat shard
        (stages 1-3) or its parameters (stage 0), so the unit's collectives are one per bucket."""
        for t in tensors:
            self._unit_of[id(t)] = (list(tensors), fn)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_group(group)
            else:
                self._adam_group(group)
        return loss

    def _muon_group(self, group: dict[str, Any]) -> None:
        beta, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
        updates: dict[int, torch.Tensor] = {}
        for p in group["params"]:
            bound = id(p) in self._unit_of
            if p.grad is None and not bound:
                continue
            grad = p.grad if p.grad is not None else torch.zeros_like(p)  # bound: its unit's owner needs it
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            buf.lerp_(grad, 1 - beta)
            updates[id(p)] = grad.lerp(buf, beta)
        results: dict[int, torch.Tensor] = {}
        for p in group["params"]:
            if id(p) not in updates:
                continue
            unit = self._unit_of.get(id(p))
            if unit is not None and id(p) not in results:  # one call per unit (a ZeRO bucket), in order
                tensors, fn = unit
                for t, o in zip(tensors, fn([updates[id(t)] for t in tensors], group)):
                    results[id(t)] = o
            update = updates[id(p)]
            if unit is not None:
                o = results[id(p)]
            elif p.dim() < 2:  # a vector the user forced onto Muon: NS needs a matrix (DeepSpeed: the same)
                o = update
            else:
                o = orthogonalized_update(update, tuple(p.shape), group["ns_method"], self.variant,
                                          group.get("ns_dtype", "float32"))
            p.mul_(1 - lr * wd)
            p.add_(o, alpha=-lr)

    def _adam_group(self, group: dict[str, Any]) -> None:
        b1, b2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = p.grad
            if not self.adam_w_mode and wd:
                grad = grad.add(p, alpha=wd)
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            t = float(state["step"])
            m, v = state["exp_avg"], state["exp_avg_sq"]
            m.lerp_(grad, 1 - b1)
            v.lerp_(grad.square(), 1 - b2)
            update = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
            if self.adam_w_mode:
                p.mul_(1 - lr * wd)
            p.add_(update, alpha=-lr)
