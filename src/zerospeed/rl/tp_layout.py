"""Rollouts on the training tensor-parallel layout (issue #32, ``hybrid_engine.inference_tp_size``).

Under AutoTP training (``tensor_parallel.autotp_size: T``) each TP rank holds column-parallel pieces of q/k/v,
gate/up (rows ``r*n:(r+1)*n`` of each projection) and row-parallel pieces of o/down (the same columns): exactly the
pieces zerospeed's inference families give a TP rank (:meth:`zerospeed.inference.models.layers.TPInfo.shard`, heads
and MLP columns split evenly, a row-parallel all-reduce after o and down). So each TP rank's rollout copy is filled
from its own training pieces as they are, with no resharding and no TP collective in the fill:
:class:`TrainingLayoutTP` is the inference engine's ``TPInfo`` whose ``shard`` keeps the piece it is given (the
piece is already this rank's share). Under ZeRO-3 the pieces are gathered over the data-parallel group as without
TP (each TP rank's shards live in its own dp group).

The generation itself runs as zerospeed's TP serving does (:mod:`zerospeed.inference.tp_runtime`): TP rank 0
schedules and samples and broadcasts each forward's batch, the other TP ranks follow it, the row-parallel layers'
all-reduces meet inside the forward over the training TP group; the finished token lists go from TP rank 0 to the
others. Every rank of a TP group must ask for the same rollout (they share one generation, as they share one
micro-batch in training): a difference is an error naming the ranks.

Checked at build, each a one-line :class:`~zerospeed.config.ConfigError`: ``inference_tp_size`` equals the training
TP degree (no resharding to another degree); the model is of the llama family (Llama, Mistral, Qwen2: the layout
above is checked for it); streamed mode (``max_resident_layers``) is off; every inference parameter split over TP
reads training pieces and every whole one (embeddings, norms, the LM head) reads whole training parameters (a
vocabulary-split LM head or embedding, which the inference engine keeps whole on TP rank 0 where logits are
computed, is all-gathered over the TP group once per fill: the one TP collective of a fill).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from zerospeed import comm
from zerospeed.config import ConfigError
from zerospeed.inference.api import RequestError
from zerospeed.inference.models.layers import TPInfo

_FAMILIES = ("llama",)


@dataclass(frozen=True)
class TrainingLayoutTP(TPInfo):
    """The inference ``TPInfo`` of a rollout copy filled from training TP pieces: ``shard`` is the identity."""

    def shard(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t


def _splits(module: torch.nn.Module) -> dict[int, Any]:
    """id of each training parameter split over the TP group -> its ``TPSplit``."""
    from zerospeed.module_inject import tp_param_splits

    params = dict(module.named_parameters(remove_duplicate=False))
    return {id(params[name]): split for name, split in tp_param_splits(module).items() if name in params}


def training_splits(module: torch.nn.Module) -> dict[int, Any]:
    """id of each training parameter split over the TP group -> its ``TPSplit`` (empty without TP)."""
    return _splits(module)


def assemble_over_tp(piece: torch.Tensor, split: Any, group: Any) -> torch.Tensor:
    """The whole tensor of a TP-split training parameter (a collective of the TP group; the weight sync's read)."""
    return _whole(piece, split, group)


def _whole(piece: torch.Tensor, split: Any, group: Any) -> torch.Tensor:
    """The whole tensor from every TP rank's piece (an all-gather over the TP group, rank order)."""
    from zerospeed.module_inject.tp_shard import assemble

    piece = piece.detach().contiguous()
    pieces = [torch.empty_like(piece) for _ in range(split.tp_size)]
    comm.all_gather(pieces, piece, group=group)
    return assemble(pieces, split)


def training_tp(train_engine: Any, cfg: Any, spec: Any) -> TPInfo:
    """The rollout copy's TP placement: ``TPInfo()`` without tensor parallelism, else this rank's place in the
    training TP group (checked as the module docstring says)."""
    mesh = comm.get_mesh()
    tp_size = mesh.tp_size if mesh is not None else 1
    if tp_size == 1 and not _splits(train_engine.module):
        if cfg.inference_tp_size != 1:
            raise ConfigError("hybrid_engine.inference_tp_size", f"{cfg.inference_tp_size}: the training engine has no "
                              "tensor parallelism (tensor_parallel.autotp_size 1) and rollouts use the training "
                              "layout; use 1")
        return TPInfo()
    if cfg.inference_tp_size != tp_size:
        raise ConfigError("hybrid_engine.inference_tp_size", f"{cfg.inference_tp_size}: rollouts run on the training "
                          f"tensor-parallel layout without resharding, so it must equal tensor_parallel.autotp_size "
                          f"({tp_size})")
    if spec.family not in _FAMILIES:
        raise ConfigError("hybrid_engine.inference_tp_size", f"rollouts under tensor parallelism are built for the "
                          f"llama family (Llama, Mistral, Qwen2); a {spec.family} model is not; use "
                          "tensor_parallel.autotp_size 1 or turn hybrid_engine off")
    if cfg.max_resident_layers:
        raise ConfigError("hybrid_engine.max_resident_layers", f"{cfg.max_resident_layers}: streamed rollouts are not "
                          "built under tensor parallelism (tensor_parallel.autotp_size > 1); use 0")
    group = mesh.tp_group
    return TrainingLayoutTP(rank=comm.get_rank(group), size=tp_size, group=group)


def check_jobs(reader: Any, model: torch.nn.Module, source: Any, spec: Any, max_len: int, dtype: torch.dtype,
               group: Any) -> None:
    """Every inference parameter split over TP must read training pieces (used as they are). An inference
    parameter kept whole that reads a vocabulary-split training parameter (AutoTP's LM head, a tied embedding)
    is assembled from the TP ranks' pieces at each fill (``reader.whole``). Compared with the same family built
    without TP, on the meta device."""
    from zerospeed.inference.models import build_model

    whole = dict(build_model(spec, max_len, dtype, "meta").named_parameters())
    name_of = {id(p): n for n, p in model.named_parameters()}
    splits = _splits(source.module)
    for job in reader.jobs:
        name = name_of[id(job.target)]
        inference_split = tuple(whole[name].shape) != tuple(job.target.shape)
        for hf in job.names:
            split = next((splits[id(p)] for p in source.params_of(hf) if id(p) in splits), None)
            if inference_split and split is None:
                raise ConfigError("hybrid_engine.inference_tp_size", f"{hf} is whole in training but split over "
                                  "tensor-parallel ranks in the inference engine; AutoTP should split it (check "
                                  "the AutoTP plan)")
            if not inference_split and split is not None:
                if split.dim != 0 or len(split.sub_sizes) != 1:
                    raise ConfigError("hybrid_engine.inference_tp_size", f"{hf} is split over tensor-parallel ranks "
                                      f"along dimension {split.dim} in training but whole in the inference engine")
                reader.whole[hf] = lambda piece, split=split: _whole(piece, split, group)


def run_tp_group(rollout: Any, engine: Any, prompts: list[list[int]], params: Any, n: int,
                 seeds: list[int] | None) -> list[list[int]]:
    """One rollout on a TP group: rank 0 runs the requests, the others follow its forwards; every rank returns
    rank 0's token lists."""
    group, rank = rollout.tp.group, rollout.tp.rank
    key = hashlib.sha256(repr((prompts, params, n, seeds)).encode()).hexdigest()
    keys = comm.all_gather_object(key, group=group)
    if len(set(keys)) > 1:
        odd = [i for i, k in enumerate(keys) if k != keys[0]]
        raise RequestError("prompts", f"tensor-parallel ranks {odd} asked for another rollout than TP rank 0; every "
                           "rank of a TP group passes the same prompts, n, seeds and sampling (one generation)")
    out, error = None, None
    if rank == 0:
        try:
            out = rollout._run(engine, rollout._add(engine, prompts, params, n, seeds))
        except Exception as exc:  # noqa: BLE001 - the followers must be released and hear it too
            error = f"{type(exc).__name__}: {exc}"
        finally:
            engine.shutdown()  # ends the followers' loops
    else:
        engine.run_worker_loop()
    out, error = comm.all_gather_object((out, error), group=group)[0]
    if error is not None:
        raise RuntimeError(f"engine.generate (tensor-parallel rank 0): {error}")
    return out
