"""Tensor parallelism in ``initialize``: the mesh, the split, the global norm and the batch check.

``initialize`` calls :func:`mesh_for` (with the config's parsed ``tensor_parallel`` section) before it
builds anything, then :func:`prepare_model` (AutoTP over the mesh's tp group, unless the model is
already split, e.g. by ``tp_model_init``) and, once the engine exists, :func:`attach` (gradient-norm
hook and first-step batch check). ZeRO receives the mesh's ``dp_group``: stage 3 then partitions
each rank's tp shard over its dp group.

Decisions:

* The tp degree comes from one place: an ``mpu`` (its groups are used as given), else
  ``mesh_param``, else ``tensor_parallel.autotp_size`` / ``tp.tp_size``; two sources that disagree
  are an error naming both numbers. Without any of them no mesh is built and nothing changes.
* ``mesh_param`` is ``{"pp": .., "dp": .., "tp": ..}`` (any subset) or a ``(pp, dp, tp)`` tuple.
  (DeepSpeed's ``(dp, sp)`` pair is for sequence parallelism, which zerospeed does not build.)
* Global gradient norm: ZeRO's squared norm is summed over the dp group; the tp hook sums it over
  the tp group too, counting each replicated parameter (norms, embeddings, row biases: the same
  gradient on every tp rank) once, so clipping sees the unsharded model's norm.
* Checkpoints stay in the name-and-offset format, in full-tensor coordinates
  (:mod:`zerospeed.module_inject.ckpt_layout`), so they load at any tp / dp degree and stage.
* Every rank of a tp group must see the same micro-batch. The first forward compares a SHA-256 of
  every tensor argument's bytes over the tp group; a difference is an error naming the ranks (a divergent
  batch would otherwise train silently on garbage).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

from zerospeed import comm
from zerospeed.comm.mesh import Mesh, MeshError
from zerospeed.config.tensor_parallel import TensorParallelConfig

__all__ = ["attach", "mesh_for", "prepare_model"]


def _mesh_param_degrees(mesh_param: Any) -> dict[str, int]:
    if isinstance(mesh_param, dict):
        unknown = set(mesh_param) - {"pp", "dp", "tp"}
        if unknown:
            raise MeshError(f"mesh_param: unknown key(s) {sorted(unknown)}; use pp, dp, tp")
        return {k: int(v) for k, v in mesh_param.items()}
    if isinstance(mesh_param, (tuple, list)) and len(mesh_param) == 3:
        return dict(zip(("pp", "dp", "tp"), (int(v) for v in mesh_param)))
    raise MeshError(f"mesh_param: {mesh_param!r} is not a (pp, dp, tp) tuple or a dict with keys pp, dp, tp")


def mesh_for(tp_cfg: TensorParallelConfig, mpu: Any = None, mesh_param: Any = None, pp: int = 1,
             model: nn.Module | None = None) -> Mesh | None:
    """The mesh ``initialize`` should use (None: plain data parallelism), for the config's parsed
    ``tensor_parallel`` section.

    A model already split by ``tp_model_init`` keeps the mesh that call built.
    """
    current = comm.get_mesh()
    if (mpu is None and mesh_param is None and model is not None and current is not None and current.tp_size > 1
            and is_split(model)):
        if tp_cfg.enabled and tp_cfg.size != current.tp_size:
            raise MeshError(f"initialize: tensor_parallel degree {tp_cfg.size} but the model was split over "
                            f"tp={current.tp_size} (tp_model_init)")
        return current
    if mpu is not None:
        if mesh_param is not None:
            raise MeshError("initialize: give mpu or mesh_param, not both")
        mesh = comm.from_mpu(mpu)
        if tp_cfg.enabled and tp_cfg.size != mesh.tp_size:
            raise MeshError(f"initialize: tensor_parallel degree {tp_cfg.size} but the mpu's model-parallel world size "
                            f"is {mesh.tp_size}")
        return mesh
    degrees = _mesh_param_degrees(mesh_param) if mesh_param is not None else {}
    tp = degrees.get("tp", tp_cfg.size)
    if tp_cfg.enabled and tp != tp_cfg.size:
        raise MeshError(f"initialize: mesh_param tp={tp} but tensor_parallel.autotp_size is {tp_cfg.size}")
    pp = degrees.get("pp", pp)
    if tp == 1 and mesh_param is None:
        return None
    return comm.build_mesh(pp=pp, tp=tp, dp=degrees.get("dp"))


def is_split(model: nn.Module) -> bool:
    """Whether the model was split already (``tp_model_init``); tensor-parallel layers inside a module
    that manages its own tensor parallelism (``tp_managed``: MoE experts) do not count."""
    from zerospeed.module_inject import TPLayer

    managed = tuple(f"{n}." for n, m in model.named_modules() if n and getattr(type(m), "tp_managed", False))
    return any((isinstance(m, TPLayer) or bool(getattr(m, "tp_splits", None))) and not n.startswith(managed)
               for n, m in model.named_modules())


def prepare_model(model: nn.Module, mesh: Mesh, tp_cfg: TensorParallelConfig, optimizer: Any) -> nn.Module:
    """Split ``model`` over the mesh's tp group (in place) unless it is split already."""
    from zerospeed.module_inject import auto_tp

    if mesh.tp_size == 1 or is_split(model):
        return model
    if isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError("initialize: an optimizer instance was built over the unsplit model's parameters; with "
                         "tensor parallelism pass the optimizer class / a callable, use the config's optimizer, or "
                         "call zerospeed.tp_model_init(model, tp_size) before building it")
    from zerospeed.compression.layers import CompressedLayer
    from zerospeed.compression.scheduler import scheduler_of

    if scheduler_of(model) is not None:  # init_compression before initialize: split, then compress the pieces
        from zerospeed.compression.init import split_compressed

        return split_compressed(model, mesh.tp_group, tp_cfg)
    if any(isinstance(m, CompressedLayer) for m in model.modules()):
        raise ValueError("tensor parallelism: the model holds compressed layers but is not the module init_compression "
                         "was applied to (e.g. pipeline virtual stages); split it first (tp_model_init) and then call "
                         "init_compression")
    return auto_tp(model, mesh.tp_group, partition_config=tp_cfg)


class TPNormHook:
    """ZeRO's dp-summed squared gradient norm -> the unsharded model's (replicated parameters once)."""

    def __init__(self, engine: Any, mesh: Mesh) -> None:
        from zerospeed.module_inject import tp_param_splits

        sharded = {id(p) for n, p in engine.module.named_parameters() if n in tp_param_splits(engine.module)}
        self.replicated = [p for p in engine.module.parameters() if p.requires_grad and id(p) not in sharded]
        self.engine, self.mesh = engine, mesh

    def __call__(self, norm_sq: torch.Tensor) -> torch.Tensor:
        from zerospeed.pipe.runtime_tied import reduced_sq_norm

        buckets = getattr(self.engine.strategy, "buckets", None)
        if buckets is None:
            raise RuntimeError("tensor parallelism: the ZeRO strategy exposes no gradient buckets to count norms on")
        replicated = reduced_sq_norm(buckets, self.replicated).to(norm_sq.device)
        if self.engine.zero_stage >= 1:
            comm.all_reduce(replicated, group=self.engine.dp_group)
        sharded = (norm_sq - replicated).clone()
        comm.all_reduce(sharded, group=self.mesh.tp_group)
        return sharded + replicated


def _digest(value: Any, h: Any) -> None:
    """Feed every tensor of a (nested) batch into the hash ``h``: dtype, shape and exact bytes."""
    if torch.is_tensor(value):
        t = value.detach().contiguous().cpu()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, (list, tuple)):
        for v in value:
            _digest(v, h)
    elif isinstance(value, dict):
        for k in sorted(value, key=str):
            h.update(str(k).encode())
            _digest(value[k], h)


class BatchCheck:
    """Called once, on the first forward: the micro-batch must be the same on every rank of the tp group."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        h = hashlib.sha256()
        _digest((args, kwargs), h)
        mine = h.hexdigest()
        everyone = comm.all_gather_object(mine, group=self.mesh.tp_group)
        ranks = self.mesh.group_ranks("model")
        for i, other in enumerate(everyone):
            if other != mine:
                raise ValueError(f"tensor parallelism: the micro-batch on rank {ranks[i]} differs from rank "
                                 f"{self.mesh.rank}'s in tp group {ranks}; every rank of a tp group must get the same "
                                 "batch (use the loader initialize returns, or shard data by the mesh's dp_rank)")


def attach(engine: Any, mesh: Mesh) -> None:
    """Hook the engine: the tp-aware global norm, the first-step batch check, checkpoint coordinates."""
    if mesh.tp_size == 1:
        return
    from zerospeed.module_inject.ckpt_layout import TPCheckpointLayout

    engine.norm_sq_hook = TPNormHook(engine, mesh)
    engine.batch_check = BatchCheck(mesh)
    engine.checkpoint_layout = TPCheckpointLayout(engine.module, mesh)


class PipelineTPCheckpoints:
    """Stands in for the checkpoint layout of a pipeline x tensor-parallel engine: refuses, by name.

    Saving, loading and consolidating such an engine would need the pipeline's stages merged into
    one index as well, which is not built; an explicit error beats files written on top of each
    other by the tp ranks.
    """

    def __init__(self) -> None:
        self.group, self.rank, self.world_size = None, comm.get_rank(), comm.get_world_size()

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("checkpoints and consolidated state dicts of a pipeline x tensor-parallel engine "
                                  "are not supported yet (pp x dp and tp x dp engines are)")

    to_full = gather_full = full_shape = runs = is_split = _refuse
