"""AutoEP for HuggingFace MoE models: replace each sparse-MoE block with zerospeed's expert-parallel
layer, weights copied, so the model trains with its experts spread over ``ep_size`` ranks.

``expert_parallel(model, ep_size)`` finds the blocks by structure, not by class name: a module
with a router ``gate`` whose ``weight`` is ``[E, H]`` and ``experts`` holding fused 3-D
``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]`` (transformers 5's Mixtral layout;
Mixtral-style blocks of other families share it). Each is replaced by :class:`HFMoEBlock`, which
keeps the block's call signature (hidden states in, hidden states out).

Routing equals HF's exactly: HF takes the softmax over all experts, keeps the top ``k`` and
renormalises them; zerospeed's top-2 gate without token dropping and without second-expert noise
computes the same weights (the argmax of the softmax is the argmax of the logits). Every token is
kept (``drop_tokens=False``), as HF does. The load-balancing loss of the last forward is in
``block.l_aux`` (HF computes its own from router logits when ``output_router_logits`` is set; the
replaced router does not record them, so leave that off or add ``l_aux`` yourself).

Refused with a clear error: ``top_k`` other than 2 (zerospeed's gate is top-1 without
renormalisation or top-2; HF top-1 renormalises to weight 1), router jitter noise in training,
and blocks with a shared expert (Qwen-MoE), whose layout this module does not map yet.
"""

from __future__ import annotations

import torch
from torch import nn

from zerospeed.moe.layer import MoE


class SwiGLUExpert(nn.Module):
    """One expert of a Mixtral-style block: ``down(act(gate(x)) * up(x))`` with a fused gate/up."""

    def __init__(self, hidden: int, intermediate: int, act: nn.Module) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


class HFMoEBlock(nn.Module):
    """Drop-in for a Mixtral-style sparse MoE block, computed by :class:`zerospeed.moe.layer.MoE`."""

    def __init__(self, moe: MoE) -> None:
        super().__init__()
        self.moe = moe
        self.l_aux = torch.zeros(())

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out, l_aux, _ = self.moe(hidden_states)
        self.l_aux = l_aux
        return out.to(hidden_states.dtype)


def _is_hf_moe_block(module: nn.Module) -> bool:
    gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
    return (gate is not None and experts is not None and isinstance(getattr(gate, "weight", None), torch.Tensor)
            and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
            and isinstance(getattr(experts, "down_proj", None), torch.Tensor))


def _convert(name: str, block: nn.Module, ep_size: int) -> HFMoEBlock:
    gate_w = block.gate.weight
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
    num_experts, hidden = gate_w.shape
    top_k = int(getattr(block, "top_k", getattr(block.gate, "top_k", 2)))
    if top_k != 2:
        raise ValueError(f"{name}: top_k={top_k}; zerospeed's expert-parallel layer reproduces HF routing for "
                         "top_k=2 only")
    if float(getattr(block, "jitter_noise", 0.0) or 0.0) > 0:
        raise ValueError(f"{name}: router_jitter_noise > 0 is not reproduced; set it to 0")
    if any(getattr(block, attr, None) is not None for attr in ("shared_expert", "shared_experts")):
        raise ValueError(f"{name}: blocks with a shared expert (Qwen-MoE) are not mapped yet")
    if gate_up.shape[0] != num_experts or down.shape[0] != num_experts or gate_up.shape[2] != hidden:
        raise ValueError(f"{name}: gate {tuple(gate_w.shape)}, gate_up_proj {tuple(gate_up.shape)} and down_proj "
                         f"{tuple(down.shape)} do not describe one Mixtral-style expert set")
    intermediate = down.shape[2]
    act = getattr(block.experts, "act_fn", None) or nn.SiLU()
    expert = SwiGLUExpert(hidden, intermediate, act).to(dtype=gate_up.dtype, device=gate_up.device)
    moe = MoE(hidden, expert, num_experts=num_experts, ep_size=ep_size, k=2, drop_tokens=False, use_rts=False,
              top2_2nd_expert_sampling=False, min_capacity=1)
    layer = moe.deepspeed_moe
    with torch.no_grad():
        layer.gate.wg.weight.copy_(gate_w.float())
        for key, mod in layer.experts.deepspeed_experts.items():
            g = int(key)
            mod.gate_up.weight.copy_(gate_up[g])
            mod.down.weight.copy_(down[g])
    return HFMoEBlock(moe).to(device=gate_up.device)


def expert_parallel(model: nn.Module, ep_size: int = 1) -> nn.Module:
    """Replace every Mixtral-style sparse MoE block of ``model`` in place (see the module docstring).

    Collective when ``ep_size > 1``: every rank must call it on the same model. Returns ``model``.
    """
    found = [(n, m) for n, m in model.named_modules() if _is_hf_moe_block(m)]
    if not found:
        kinds = sorted({type(m).__name__ for m in model.modules() if "moe" in type(m).__name__.lower()})
        raise ValueError(f"expert_parallel: no Mixtral-style MoE block (gate.weight [E, H], experts.gate_up_proj "
                         f"[E, 2I, H], experts.down_proj [E, H, I]) in {type(model).__name__}"
                         + (f"; MoE-like modules found: {', '.join(kinds)}" if kinds else ""))
    from zerospeed.zero.init import GatheredParameters

    for name, block in found:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        with GatheredParameters(list(block.parameters())):  # built under zero.Init: read whole values
            replacement = _convert(name, block, ep_size)
        setattr(parent, attr, replacement)
    return model
