"""The full state dict of a mixture-of-experts model on data-parallel rank 0 (``save_16bit_model``,
``consolidated_state_dict``, HF ``save_pretrained`` through the engine).

With ``ep_size > 1`` a rank holds only its own experts (``deepspeed_experts.<g>`` for its global
indices ``g``), so rank 0's module state is missing the other expert-parallel ranks' experts.
:func:`add_experts_of_other_ranks` completes it: every rank gathers its expert parameters (a no-op
below ZeRO-3; at stage 3 an all-gather over each bucket's expert-data-parallel group, a collective
on every rank), the first rank of each expert-data-parallel group contributes them (the other
replicas hold the same values), and rank 0 adds the names it lacks.

A HF model whose MoE blocks :func:`zerospeed.moe.hf.expert_parallel` replaced gets its blocks' entries
back in HF's layout (:func:`zerospeed.moe.hf.hf_state_dict`), so ``save_pretrained`` writes a folder
the original HF class loads.

Decisions: the tensors travel with ``all_gather_object`` over the data-parallel group (one call,
rank 0 must hold the whole model anyway); expert names are global, so nothing is renamed; entries
are added after rank 0's own keys, in global-name order per rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zerospeed import comm
from zerospeed.moe.groups import reduction_group_of
from zerospeed.moe.registry import is_expert_param


def _has_expert_parallelism(model: nn.Module) -> bool:
    from zerospeed.moe.layer import MoE

    return any(isinstance(m, MoE) and m.ep_size > 1 for m in model.modules())


def add_experts_of_other_ranks(model: nn.Module, state: dict[str, torch.Tensor], dp_group: Any,
                               dp_rank: int) -> dict[str, torch.Tensor]:
    """``state`` (rank 0's consolidated state dict; ``{}`` elsewhere) with every expert of the model.

    A collective over the data-parallel group when the model has expert parallelism; returns
    ``state`` unchanged otherwise. Every rank must call it.
    """
    from zerospeed.moe.hf import hf_state_dict  # blocks replaced in a HF model: back to HF's names

    if not _has_expert_parallelism(model):
        return hf_state_dict(model, state)
    from zerospeed.zero.init import GatheredParameters

    experts = [(n, p) for n, p in model.named_parameters() if is_expert_param(p)]
    mine: dict[str, torch.Tensor] = {}
    with GatheredParameters([p for _, p in experts]):
        for name, p in experts:
            spec = reduction_group_of(p)
            if spec is None or spec[1] == 0:  # the first replica of these experts contributes them
                mine[name] = p.detach().to("cpu", copy=True)
    everything = comm.all_gather_object(mine, dp_group)
    if dp_rank != 0:
        return state
    out = dict(state)
    for part in everything:
        for name in sorted(part):
            out.setdefault(name, part[name])
    return hf_state_dict(model, out)
