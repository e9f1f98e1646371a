"""μP optimizers: DeepSpeed's ``MuAdam``, ``MuAdamW`` and ``MuSGD`` (which import them from Microsoft's ``mup``).

zerospeed builds the same param groups itself (facts from ``mup`` 1.0.0 ``mup/optim.py``) and hands them
to torch's Adam / AdamW / SGD with the config's params, so neither ``mup`` nor anything else is imported.
The model still needs ``mup.set_base_shapes(model, base)``: each parameter's ``infshape`` (set by mup; read
here, duck-typed: ``ninf()``, ``width_mult()``, ``fanin_fanout_mult_ratio()``) says how it scales.

* MuAdam / MuAdamW: a matrix-like parameter (two infinite dims) with width multiplier w gets
  ``lr / w`` and ``weight_decay * w``; the others keep the group's values.
* MuSGD: vector-like (one infinite dim): ``lr * w``, ``weight_decay / w``; matrix-like with
  ``r = fanin_fanout_mult_ratio()``: ``lr / r``, ``weight_decay * r``; the rest unchanged.
* more than two infinite dims: refused (mup raises NotImplementedError too).

The result is a torch optimizer with more groups, element-wise, so it runs at every ZeRO stage.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["MU_OPTIMIZERS", "mu_param_groups"]

MU_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "MuAdam": torch.optim.Adam, "MuAdamW": torch.optim.AdamW, "MuSGD": torch.optim.SGD}


def mu_param_groups(kind: str, groups: list[dict[str, Any]], kwargs: dict[str, Any],
                    names: dict[int, str] | None = None) -> list[dict[str, Any]]:
    """Split each group by μP scaling class (see the module docstring); empty groups are dropped."""
    out: list[dict[str, Any]] = []
    for g in groups:
        base = {k: v for k, v in g.items() if k != "params"}
        base.setdefault("lr", kwargs["lr"])  # the factory fills in the torch class's default
        base.setdefault("weight_decay", kwargs.get("weight_decay", 0.0))
        split: dict[tuple[str, float], list[Any]] = {}
        for p in g["params"]:
            shape = getattr(p, "infshape", None)
            if shape is None:
                name = (names or {}).get(id(p), f"of shape {tuple(p.shape)}")
                raise ValueError(f"{kind}: parameter {name} has no `infshape`; call mup.set_base_shapes(model, "
                                 "base_model) before zerospeed.initialize")
            ninf = shape.ninf()
            if ninf > 2:
                raise ValueError(f"{kind}: a parameter with {ninf} infinite dimensions is not supported (mup "
                                 "neither)")
            if kind == "MuSGD":
                key = (("vector", shape.width_mult()) if ninf == 1 else
                       ("matrix", shape.fanin_fanout_mult_ratio()) if ninf == 2 else ("fixed", 1.0))
            else:
                key = ("matrix", shape.width_mult()) if ninf == 2 else ("vector", 1.0)
            split.setdefault(key, []).append(p)
        for (cls, mult), params in split.items():
            group = dict(base, params=params)
            if kind == "MuSGD" and cls == "vector":
                group["lr"], group["weight_decay"] = group["lr"] * mult, group["weight_decay"] / mult
            elif cls == "matrix":
                group["lr"], group["weight_decay"] = group["lr"] / mult, group["weight_decay"] * mult
            out.append(group)
    return out
