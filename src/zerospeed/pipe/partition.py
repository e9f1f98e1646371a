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

Balancing (:func:`partition_balanced`) first finds the smallest achievable maximum stage weight,
then, among partitions achieving it, places each boundary as close as possible to an equal share
of the total weight (then of the layer count), so unweighted layers (for instance embeddings
under ``type:`` partitioning) are spread instead of piling up on the last stage.
"""
from __future__ import annotations

import bisect
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


def _min_parts_from(prefix: list[int], limit: int) -> list[int]:
    """For each start i, the fewest contiguous parts of weight <= limit covering items i..n-1."""
    n = len(prefix) - 1
    fewest = [0] * (n + 1)
    for i in range(n - 1, -1, -1):
        # furthest end j with prefix[j] - prefix[i] <= limit (at least i + 1: limit >= max weight)
        j = bisect.bisect_right(prefix, prefix[i] + limit, lo=i + 1) - 1
        fewest[i] = 1 + fewest[j]
    return fewest


def partition_balanced(weights: Sequence[int], num_parts: int) -> list[int]:
    """Contiguous, non-empty parts minimizing the heaviest part, boundaries spread evenly."""
    n = len(weights)
    if not 1 <= num_parts <= n:
        raise ValueError(f"num_parts: need 1 <= num_parts <= {n} items, got {num_parts}")
    if any(isinstance(w, bool) or not isinstance(w, int) or w < 0 for w in weights):
        raise ValueError(f"weights: must be non-negative ints, got {list(weights)!r}")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    low, high = max(weights), prefix[-1]
    while low < high:  # smallest feasible bottleneck
        mid = (low + high) // 2
        if _min_parts_from(prefix, mid)[0] <= num_parts:
            high = mid
        else:
            low = mid + 1
    fewest = _min_parts_from(prefix, low)
    total = prefix[-1]
    parts = [0]
    for k in range(1, num_parts):
        left = num_parts - k  # parts still to place after this boundary
        start = parts[-1]
        best: tuple[float, float, int] | None = None
        for j in range(start + 1, n - left + 1):
            if prefix[j] - prefix[start] > low:
                break
            if fewest[j] > left:  # suffix j..n-1 cannot fit in the parts left
                continue
            score = (abs(prefix[j] - total * k / num_parts), abs(j - n * k / num_parts), j)
            if best is None or score < best:
                best = score
        assert best is not None  # feasibility of `low` guarantees a candidate
        parts.append(best[2])
    parts.append(n)
    return parts


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
