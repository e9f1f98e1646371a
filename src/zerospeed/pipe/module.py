"""``PipelineModule``: one pipeline stage of a model given as a flat list of layers (DeepSpeed API).

Decisions:

* The constructor follows DeepSpeed's positional order (``layers, num_stages, topology, loss_fn,
  seed_layers, seed_fn, base_seed, partition_method, activation_checkpoint_interval,
  activation_checkpoint_func, checkpointable_layers, dynamic_shape``) and adds the keyword
  ``stage_id``: the stage to build. When it is omitted the stage comes from the topology
  coordinate of this process's rank (torch.distributed initialized) or is 0 for one stage.
* ``num_stages`` counts global (virtual) stages. With a ``topology`` it defaults to the topology's
  pipe dimension and may be a multiple of it (interleaving: stage ``s`` runs on pipe rank
  ``s % num_pp``). Without one, the topology is ``PipeTopology(num_stages, world // num_stages)``
  (world = 1 pipeline when torch.distributed is not initialized).
* Only this stage's layers are built. Built layers are registered under their *global* index
  (``"3.weight"``), as DeepSpeed does, so state dict keys do not depend on the partition; tied
  modules live in ``tied_modules[key]``, built once per stage however often the key occurs there.
* ``seed_layers=True`` seeds the global RNG with ``base_seed + layer_index`` (``seed_fn`` if given)
  before each build, so a layer gets the same initial weights whichever stage builds it. A tied
  module is seeded with the index of its key's *first* occurrence, so every owning stage builds
  identical copies. (DeepSpeed also reseeds during forward; we do not touch the RNG in forward.)
* Activation checkpointing wraps each run of ``activation_checkpoint_interval`` consecutive layers
  in :func:`zerospeed.checkpointing.checkpoint` (DeepSpeed's default; torch's non-reentrant
  checkpoint unless partitioned / host-offloaded activations are configured) or the given
  ``activation_checkpoint_func`` when gradients are enabled. A chunk is checkpointed if it has
  parameters, or, with ``checkpointable_layers``, if all its layers' class names are listed
  (DeepSpeed's rule).
* Tied weights: ``tied_stages[key]`` lists the stages owning ``key`` (known without building
  anything); the runtime sums the gradients of ``tied_parameters(key)`` over the ranks of those
  stages after backward, and broadcasts them from the lowest owning stage at start-up (needed
  when ``seed_layers`` is off: each stage then draws its own initial copy).
"""
from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerospeed import checkpointing
from zerospeed.pipe.layer_spec import LayerSpec, TiedLayerSpec
from zerospeed.pipe.partition import partition_layers
from zerospeed.pipe.topology import PipeTopology, ProcessTopology

__all__ = ["PipelineModule"]


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def _resolve_attr(module: nn.Module, path: str) -> Any:
    value: Any = module
    for part in path.split("."):
        value = getattr(value, part)
    return value


class PipelineModule(nn.Module):
    """The layers of one pipeline stage, run in order by ``forward``."""

    def __init__(
        self,
        layers: Iterable[Any],
        num_stages: int | None = None,
        topology: ProcessTopology | None = None,
        loss_fn: Callable[..., Any] | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], Any] | None = None,
        base_seed: int = 1234,
        partition_method: str | Sequence[int] = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable[..., Any] | None = None,
        checkpointable_layers: Sequence[str] | None = None,
        dynamic_shape: bool = False,
        *,
        stage_id: int | None = None,
    ) -> None:
        super().__init__()
        if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
            raise ValueError(f"layers: expected a list of layers, got {layers!r}")
        self._layer_specs: list[Any] = list(layers)
        if not self._layer_specs:
            raise ValueError("layers: the list of layers is empty")
        self._check_layers()
        interval = activation_checkpoint_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
            raise ValueError(f"activation_checkpoint_interval: must be an int >= 0, got {interval!r}")

        self._topo, self.num_stages = self._resolve_topology(topology, num_stages)
        self.stage_id = self._resolve_stage(stage_id)
        self.loss_fn = loss_fn
        self.seed_layers = seed_layers
        self.seed_fn = seed_fn
        self.base_seed = base_seed
        self.activation_checkpoint_interval = interval
        self.activation_checkpoint_func = activation_checkpoint_func or checkpointing.checkpoint
        self.checkpointable_layers = list(checkpointable_layers) if checkpointable_layers else None
        self.dynamic_shape = dynamic_shape
        self.partition_method = partition_method  # kept so the pipeline engine can re-partition (virtual stages)

        self.parts: list[int] = partition_layers(self._layer_specs, self.num_stages, partition_method)
        self._local_start = self.parts[self.stage_id]
        self._local_stop = self.parts[self.stage_id + 1]
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self.tied_stages: dict[str, list[int]] = self._tied_stage_map()
        self.forward_funcs: list[Callable[[Any], Any]] = []
        self.local_layer_indices: list[int] = list(range(self._local_start, self._local_stop))
        for index in self.local_layer_indices:
            self.forward_funcs.append(self._materialize(index))

    # ----------------------------------------------------------------- construction helpers
    def _check_layers(self) -> None:
        tied_types: dict[str, type] = {}
        for index, layer in enumerate(self._layer_specs):
            if isinstance(layer, TiedLayerSpec):
                first = tied_types.setdefault(layer.key, layer.typename)
                if first is not layer.typename:
                    raise ValueError(f"layers[{index}]: tied key {layer.key!r} is a {first.__name__} "
                                     f"elsewhere but a {layer.typename.__name__} here")
            elif not isinstance(layer, (LayerSpec, nn.Module)) and not callable(layer):
                raise ValueError(f"layers[{index}]: expected an nn.Module, LayerSpec, TiedLayerSpec "
                                 f"or callable, got {layer!r}")

    def _resolve_topology(
        self, topology: ProcessTopology | None, num_stages: int | None
    ) -> tuple[ProcessTopology, int]:
        if num_stages is not None and (isinstance(num_stages, bool) or not isinstance(num_stages, int)
                                       or num_stages < 1):
            raise ValueError(f"num_stages: must be a positive int, got {num_stages!r}")
        if topology is not None:
            if not isinstance(topology, ProcessTopology) or "pipe" not in topology.get_axis_names():
                raise ValueError(f"topology: expected a ProcessTopology with a 'pipe' axis, got {topology!r}")
            num_pp = topology.get_dim("pipe")
            if num_stages is None:
                return topology, num_pp
            if num_stages % num_pp:
                raise ValueError(f"num_stages: {num_stages} is not a multiple of the topology's "
                                 f"{num_pp} pipeline ranks")
            return topology, num_stages
        if num_stages is None:
            raise ValueError("num_stages: give num_stages or topology")
        world_size = dist.get_world_size() if _dist_ready() else num_stages
        if world_size % num_stages:
            raise ValueError(f"num_stages: world size {world_size} is not divisible by {num_stages} stages")
        return PipeTopology(num_stages, world_size // num_stages), num_stages

    def _resolve_stage(self, stage_id: int | None) -> int:
        if stage_id is None:
            num_pp = self._topo.get_dim("pipe")
            if (_dist_ready() and num_pp == self.num_stages
                    and self._topo.world_size() == dist.get_world_size()):
                return int(self._topo.get_coord(dist.get_rank()).pipe)
            if self.num_stages == 1:
                return 0
            raise ValueError("stage_id: required when it cannot be derived from this process's rank "
                             "(torch.distributed not initialized, or virtual stages)")
        if isinstance(stage_id, bool) or not isinstance(stage_id, int) or not 0 <= stage_id < self.num_stages:
            raise ValueError(f"stage_id: must be in [0, {self.num_stages}), got {stage_id!r}")
        return stage_id

    def _tied_stage_map(self) -> dict[str, list[int]]:
        stages: dict[str, set[int]] = {}
        for index, layer in enumerate(self._layer_specs):
            if isinstance(layer, TiedLayerSpec):
                stages.setdefault(layer.key, set()).add(self.stage_of_layer(index))
        return {key: sorted(owners) for key, owners in stages.items()}

    def _build(self, spec: LayerSpec, index: int) -> nn.Module:
        if self.seed_layers:
            (self.seed_fn or torch.manual_seed)(self.base_seed + index)
        return spec.build()

    def _materialize(self, index: int) -> Callable[[Any], Any]:
        layer = self._layer_specs[index]
        if isinstance(layer, TiedLayerSpec):
            if layer.key not in self.tied_modules:
                first = next(i for i, spec in enumerate(self._layer_specs)
                             if isinstance(spec, TiedLayerSpec) and spec.key == layer.key)
                self.tied_modules[layer.key] = self._build(layer, first)
                self.tied_weight_attrs[layer.key] = list(layer.tied_weight_attr)
            module = self.tied_modules[layer.key]
            return module if layer.forward_fn is None else functools.partial(layer.forward_fn, module)
        if isinstance(layer, LayerSpec):
            module = self._build(layer, index)
            self.add_module(str(index), module)
            return module
        if isinstance(layer, nn.Module):
            self.add_module(str(index), layer)
            return layer
        return layer

    # ----------------------------------------------------------------- queries
    def topology(self) -> ProcessTopology:
        return self._topo

    def stage_of_layer(self, index: int) -> int:
        """The stage that owns global layer ``index``."""
        if not 0 <= index < len(self._layer_specs):
            raise ValueError(f"index: must be in [0, {len(self._layer_specs)}), got {index!r}")
        return bisect.bisect_right(self.parts, index) - 1

    @property
    def tied_weights(self) -> dict[str, nn.Module]:
        """Tied key -> the module built on this stage (only keys this stage owns)."""
        return dict(self.tied_modules.items())

    def tied_parameters(self, key: str) -> list[nn.Parameter]:
        """The shared parameters of tied ``key`` on this stage (``tied_weight_attr`` resolved)."""
        if key not in self.tied_modules:
            raise ValueError(f"key: {key!r} is not tied on stage {self.stage_id} "
                             f"(local keys: {sorted(self.tied_modules)})")
        module = self.tied_modules[key]
        return [_resolve_attr(module, attr) for attr in self.tied_weight_attrs[key]]

    # ----------------------------------------------------------------- forward
    def _is_checkpointable(self, funcs: Sequence[Callable[[Any], Any]]) -> bool:
        modules = [f.args[0] if isinstance(f, functools.partial) and f.args else f for f in funcs]
        if self.checkpointable_layers is not None:
            return all(type(m).__name__ in self.checkpointable_layers for m in modules)
        return any(isinstance(m, nn.Module) and any(True for _ in m.parameters()) for m in modules)

    def _run_range(self, begin: int, end: int) -> Callable[..., Any]:
        funcs = self.forward_funcs[begin:end]

        def run(*inputs: Any) -> Any:
            x: Any = inputs[0] if len(inputs) == 1 else inputs
            for func in funcs:
                x = func(x)
            return x

        return run

    def forward(self, forward_input: Any) -> Any:
        interval = self.activation_checkpoint_interval
        num_funcs = len(self.forward_funcs)
        if interval == 0 or not torch.is_grad_enabled():
            return self._run_range(0, num_funcs)(forward_input)
        x = forward_input
        for begin in range(0, num_funcs, interval):
            end = min(begin + interval, num_funcs)
            run = self._run_range(begin, end)
            args = x if isinstance(x, tuple) else (x,)
            if self._is_checkpointable(self.forward_funcs[begin:end]):
                x = self.activation_checkpoint_func(run, *args)
            else:
                x = run(*args)
        return x

    def extra_repr(self) -> str:
        return (f"stage_id={self.stage_id}, num_stages={self.num_stages}, "
                f"layers=[{self._local_start}, {self._local_stop}) of {len(self._layer_specs)}")
