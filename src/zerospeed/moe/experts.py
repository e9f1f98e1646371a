"""The local experts of one rank, computed either grouped (one batched call) or one at a time.

``Experts(expert, num_local_experts, first_expert=g0)`` deep-copies the user's expert module; the
copies live in ``deepspeed_experts`` (DeepSpeed's attribute name) keyed by their **global** expert
index ``g0 .. g0 + num_local_experts - 1``, so parameter names read
``deepspeed_moe.experts.deepspeed_experts.<global index>.<param>`` on every rank. Names are then
unique across expert-parallel ranks, and a checkpoint (addressed by parameter name) written at one
expert-parallel degree loads at any other with no conversion: a rank simply finds its experts'
names. Every parameter is marked as an expert parameter of its group in
:mod:`zerospeed.moe.registry`.

Input ``[E_local, T, M]`` (``T`` token slots per expert), output ``[E_local, T, M_out]``.

Decisions:

* ``grouped=True`` (default): the experts' parameters are stacked along a new leading dimension
  (``torch.stack`` keeps autograd to each expert's own parameters) and one ``torch.func.vmap`` of
  ``functional_call`` over the experts runs the whole layer, so each Linear of the expert becomes
  one batched matmul over all local experts instead of a Python loop of small matmuls. Any expert
  module works (vmap traces its ops), dropout included (``randomness="different"``).
* Built under ``zero.Init``: the user's expert was partitioned as it was built, so it is gathered
  for the copies, which stay whole until the engine shards them over their expert-data-parallel
  group (``zero.Init`` would shard them over the whole data-parallel group, as replicas).
* Under ZeRO-3 the grouped forward's parameters are declared with
  ``zero.register_external_parameter`` (it reads them without calling the experts), so they are
  gathered around the forward of this module; the per-expert loop needs nothing (each expert's
  own forward gathers its parameters).
* ``grouped=False``: a Python loop over the experts (the reference the grouped path is tested and
  benchmarked against).
* ``tp=(tp_group, tp_size, tp_rank)`` with ``tp_size > 1`` (expert tensor parallelism): each copy
  is split by :func:`zerospeed.module_inject.split_expert_ffn` (column-parallel input layers,
  row-parallel output layer, all-reduced over the tp group), and the experts run one at a time:
  the tp layers' collectives are autograd functions that ``vmap`` cannot batch, so the grouped
  path would need a second, collective-free copy of the layers' arithmetic. ``absent_tp_splits``
  names the same splits for the experts of the other expert-parallel ranks (``num_experts`` in
  all), so a consolidated state dict holding them is merged over tp like the local ones.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, vmap

from zerospeed.moe.registry import mark_expert_param
from zerospeed.zero.init import register_external_parameter


def whole_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` with its full values, also when ``zero.Init`` partitioned it (its
    parameters are then empty placeholders: they are gathered for the copy). The copy's parameters
    are ordinary tensors; ZeRO-3 partitions them over their own group when the engine is built."""
    from zerospeed.zero.init import GatheredParameters

    with GatheredParameters(list(module.parameters())):
        return copy.deepcopy(module)


class Experts(nn.Module):
    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None,
                 grouped: bool = True, first_expert: int = 0, tp: tuple[Any, int, int] | None = None,
                 num_experts: int | None = None) -> None:
        super().__init__()
        if not isinstance(expert, nn.Module):
            raise TypeError(f"MoE: expert must be a torch.nn.Module, got {type(expert).__name__}")
        self.tp_size = 1 if tp is None else tp[1]
        copies = {}
        for i in range(num_local_experts):
            piece = whole_copy(expert)
            if self.tp_size > 1:
                from zerospeed.module_inject import split_expert_ffn

                piece = split_expert_ffn(piece, *tp)
            copies[str(first_expert + i)] = piece
        self.deepspeed_experts = nn.ModuleDict(copies)
        self.first_expert = first_expert
        self.num_local_experts = num_local_experts
        self.num_experts = num_experts if num_experts is not None else num_local_experts
        grouped = grouped and self.tp_size == 1
        self.grouped = grouped
        if expert_group_name is not None:
            for p in self.parameters():
                mark_expert_param(p, expert_group_name)
        if grouped and num_local_experts > 1:
            # the grouped forward reads every local expert's parameters without calling the experts:
            # ZeRO-3 gathers them (over their expert-dp group) around this module's forward
            for p in self.parameters():
                register_external_parameter(self, p)

    def absent_tp_splits(self) -> dict[str, Any]:
        """``{"deepspeed_experts.<g>.<param>": TPSplit}`` for every expert ``g`` of the other ranks."""
        if self.tp_size == 1:
            return {}
        from zerospeed.module_inject import tp_param_splits

        template = tp_param_splits(next(iter(self.deepspeed_experts.values())))
        local = range(self.first_expert, self.first_expert + self.num_local_experts)
        return {f"deepspeed_experts.{g}.{name}": split for g in range(self.num_experts) if g not in local
                for name, split in template.items()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != self.num_local_experts:
            raise ValueError(f"Experts: input has {x.shape[0]} expert slices, expected {self.num_local_experts}")
        if not self.grouped or self.num_local_experts == 1:
            return torch.stack([expert(x[i]) for i, expert in enumerate(self.deepspeed_experts.values())])
        experts = list(self.deepspeed_experts.values())
        first = experts[0]
        names = [n for n, _ in first.named_parameters()]
        buffers = [n for n, _ in first.named_buffers()]
        stacked = {n: torch.stack([dict(e.named_parameters())[n] for e in experts]) for n in names}
        stacked.update({n: torch.stack([dict(e.named_buffers())[n] for e in experts]) for n in buffers})

        def one(state: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
            return functional_call(first, state, (tokens,))

        return vmap(one, randomness="different")(stacked, x)
