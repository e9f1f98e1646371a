"""Split a list of layers into contiguous pipeline stages, without building anything for real.

``partition_layers(layers, num_stages, method)`` returns stage boundaries ``[0, b1, ..., L]``:
stage ``s`` owns layers ``[parts[s], parts[s + 1])``. Every stage gets at least one layer.
Methods (DeepSpeed's names; the string is case-insensitive except for the regex):

* ``"uniform"``: balance layer counts; the first ``L % num_stages`` stages get one extra layer
  (DeepSpeed's ``partition_uniform``).
* ``"parameters"``: balance trainable parameter counts. A ``LayerSpec`` is counted by building it
  on the meta device (``with torch.device("meta")``), which allocates no storage; should a layer's
  constructor not work on meta, it is built on CPU once with a warning. Modules are counted
  directly; plain callables count 0.
* ``"type:<regex>"``: balance the number of layers whose class name matches ``regex``
  (``re.search``, case-insensitive, as DeepSpeed).
* a sequence of ints: explicit boundaries, validated.

Balancing (:func:`partition_balanced`) reproduces DeepSpeed's own dynamic program split for split
(see its docstring), so a PipelineModule has the same stages under zerospeed as under DeepSpeed;
``tests/test_compat_pipe.py`` holds split points computed by DeepSpeed 0.19.8 itself.
"""
from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from zerospeed.pipe.layer_spec import LayerSpec

__all__ = ["count_layer_parameters", "layer_type_name", "partition_balanced", "partition_layers",
           "partition_uniform"]


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries splitting ``num_items`` into ``num_parts`` counts differing by at most one."""
    chunk, extra = divmod(num_items, num_parts)
    parts = [0]
    for part in range(num_parts):
        parts.append(parts[-1] + chunk + (1 if part < extra else 0))
    return parts


def partition_balanced(weights: Sequence[int], num_parts: int) -> list[int]:
    """Contiguous, non-empty parts chosen exactly as DeepSpeed's ``partition_balanced`` chooses them.

    DeepSpeed (``deepspeed/runtime/utils.py``, 0.19.8) solves a linear-partition dynamic program
    whose state ``(i, j)`` (first ``i`` items in ``j`` parts) keeps one candidate: the one with the
    smallest spread ``max part - min part``, ties going to the *latest* previous boundary. The
    answer follows the stored boundaries back from ``(n, num_parts)``. This is not the partition
    with the lightest heaviest part (the spread objective is not decomposable), but it is what
    DeepSpeed users get, and matching it keeps a script's stages identical after the switch:
    for the AlexNet of DeepSpeed's pipeline example it splits 2 stages at layer 19, not 17.
    Sums are exact integers (DeepSpeed's float64 agrees below 2**53).
    """
    n = len(weights)
    if not 1 <= num_parts <= n:
        raise ValueError(f"num_parts: need 1 <= num_parts <= {n} items, got {num_parts}")
    if any(isinstance(w, bool) or not isinstance(w, int) or w < 0 for w in weights):
        raise ValueError(f"weights: must be non-negative ints, got {list(weights)!r}")
    if n == num_parts:
        return list(range(n + 1))
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    # best[(i, j)] = (spread, heaviest, lightest, previous boundary)
    best: dict[tuple[int, int], tuple[int, int, int, int]] = {(0, 0): (0, 0, -1, 0)}
    for i in range(1, n + 1):
        for j in range(1, min(i, num_parts) + 1):
            chosen: tuple[int, int, int, int] | None = None
            for k in range(j - 1, i):
                prev = best.get((k, j - 1))
                if prev is None:
                    continue
                part = prefix[i] - prefix[k]
                heaviest = max(prev[1], part)
                lightest = part if prev[2] < 0 else min(prev[2], part)
                spread = heaviest - lightest
                if chosen is None or spread <= chosen[0]:  # ties: the later boundary wins
                    chosen = (spread, heaviest, lightest, k)
            if chosen is not None:
                best[(i, j)] = chosen
    parts = [n]
    for j in range(num_parts, 0, -1):
        parts.append(best[(parts[-1], j)][3])
    return parts[::-1]


def layer_type_name(layer: Any) -> str:
    """The class name ``type:`` partitioning matches against."""
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", type(layer).__name__)


def count_layer_parameters(layer: Any) -> int:
    """Trainable parameters of one layer; a LayerSpec is built on the meta device to count."""
    if isinstance(layer, LayerSpec):
        try:
            with torch.device("meta"):
                module = layer.build()
        except Exception as error:  # some constructors do real compute; count once on CPU
            warnings.warn(f"counting parameters of {layer!r} on CPU: meta-device build failed ({error})",
                          stacklevel=3)
            module = layer.build()
    elif isinstance(layer, nn.Module):
        module = layer
    else:
        return 0
    if not isinstance(module, nn.Module):
        return 0
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def _explicit(boundaries: Sequence[Any], num_layers: int, num_stages: int) -> list[int]:
    parts = list(boundaries)
    if any(isinstance(b, bool) or not isinstance(b, int) for b in parts):
        raise ValueError(f"partition_method: boundaries must be ints, got {parts!r}")
    if len(parts) != num_stages + 1:
        raise ValueError(f"partition_method: {num_stages} stages need {num_stages + 1} boundaries "
                         f"[0, ..., {num_layers}], got {len(parts)}: {parts!r}")
    if parts[0] != 0 or parts[-1] != num_layers:
        raise ValueError(f"partition_method: boundaries must start at 0 and end at {num_layers} "
                         f"(the number of layers), got {parts!r}")
    if any(b >= c for b, c in zip(parts, parts[1:])):
        raise ValueError(f"partition_method: boundaries must be strictly increasing "
                         f"(each stage needs a layer), got {parts!r}")
    return parts


def partition_layers(
    layers: Sequence[Any], num_stages: int, method: str | Sequence[int] = "parameters"
) -> list[int]:
    """Stage boundaries ``[0, b1, ..., len(layers)]`` for ``num_stages`` stages (see module doc)."""
    num_layers = len(layers)
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages: must be a positive int, got {num_stages!r}")
    if num_stages > num_layers:
        raise ValueError(f"num_stages: {num_stages} stages for {num_layers} layers; "
                         "every stage needs at least one layer")
    if not isinstance(method, str):
        if isinstance(method, Sequence):
            return _explicit(method, num_layers, num_stages)
        raise ValueError(f"partition_method: expected a method name or a list of boundaries, got {method!r}")
    name = method.strip()
    lowered = name.lower()
    if lowered == "uniform":
        return partition_uniform(num_layers, num_stages)
    if lowered == "parameters":
        return partition_balanced([count_layer_parameters(layer) for layer in layers], num_stages)
    if lowered.startswith("type:"):
        pattern = name[len("type:"):]
        try:
            regex = re.compile(pattern, re.IGNORECASE)
        except re.error as error:
            raise ValueError(f"partition_method: bad regex {pattern!r}: {error}") from None
        weights = [1 if regex.search(layer_type_name(layer)) else 0 for layer in layers]
        if not any(weights):
            names = sorted({layer_type_name(layer) for layer in layers})
            raise ValueError(f"partition_method: {method!r} matches no layer (layer types: {names})")
        return partition_balanced(weights, num_stages)
    raise ValueError(f"partition_method: {method!r} is not one of 'parameters', 'uniform', "
                     "'type:<regex>', or a list of stage boundaries")
