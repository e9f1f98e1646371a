"""AutoEP for HuggingFace MoE models: replace each sparse-MoE block with zerospeed's expert-parallel
layer, weights copied, so the model trains with its experts spread over ``ep_size`` ranks.

``expert_parallel(model, ep_size)`` finds the blocks by structure: a module with a router ``gate``
whose ``weight`` is ``[E, H]`` and ``experts`` holding fused 3-D ``gate_up_proj`` ``[E, 2I, H]``
and ``down_proj`` ``[E, H, I]`` (transformers 5's layout). Each is replaced by
:class:`HFMoEBlock`, which keeps the block's call signature (hidden states in, hidden states out).

Routers reproduced (by class, since routers of the same shape score differently): Mixtral's,
Qwen2-MoE's, Qwen3-MoE's and OLMoE's: softmax over all experts in float32, the top ``k`` kept,
renormalised when the model says so (Mixtral always; the others by ``norm_topk_prob``).
zerospeed's gate without token dropping and without noise computes the same weights for any
``k``. Every token is kept (``drop_tokens=False``), as HF does. Qwen2-MoE's shared expert and its
sigmoid gate stay dense modules of the block (replicated, data-parallel), added to the experts'
output as HF adds them. The load-balancing loss of the last forward is in ``block.l_aux`` (HF
computes its own from router logits when ``output_router_logits`` is set; the replaced router does
not record them, so leave that off or add ``l_aux`` yourself).

Refused with a clear error: another router class (DeepSeek's grouped sigmoid scoring, PhiMoE's
sparsemixer...), router jitter noise in training, and a shared expert without the layout above.
"""

from __future__ import annotations

import torch
from torch import nn

from zerospeed.moe.layer import MoE


#: router class -> the attribute that says whether top-k weights are renormalised (None: always)
ROUTERS: dict[str, str | None] = {"MixtralTopKRouter": None, "Qwen2MoeTopKRouter": "norm_topk_prob",
                                  "Qwen3MoeTopKRouter": "norm_topk_prob", "OlmoeTopKRouter": "norm_topk_prob"}


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
    """Drop-in for a HF sparse MoE block, computed by :class:`zerospeed.moe.layer.MoE` (plus the
    block's shared expert, if it has one: ``out + sigmoid(shared_expert_gate(x)) * shared_expert(x)``)."""

    def __init__(self, moe: MoE, shared_expert: nn.Module | None = None,
                 shared_expert_gate: nn.Module | None = None) -> None:
        super().__init__()
        self.moe = moe
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate
        self.l_aux = torch.zeros(())

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out, l_aux, _ = self.moe(hidden_states)
        self.l_aux = l_aux
        out = out.to(hidden_states.dtype)
        if self.shared_expert is not None:
            shared = self.shared_expert(hidden_states)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(hidden_states)) * shared
            out = out + shared
        return out


def _is_hf_moe_block(module: nn.Module) -> bool:
    gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
    return (gate is not None and experts is not None and isinstance(getattr(gate, "weight", None), torch.Tensor)
            and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
            and isinstance(getattr(experts, "down_proj", None), torch.Tensor))


def _convert(name: str, block: nn.Module, ep_size: int, top_k_override: int | None = None,
             renormalize_override: bool | None = None, grouped: bool = True) -> HFMoEBlock:
    gate_w = block.gate.weight
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
    num_experts, hidden = gate_w.shape
    router = type(block.gate).__name__
    if router not in ROUTERS:
        raise ValueError(f"{name}: router {router} is not reproduced by zerospeed's gate (supported: "
                         f"{', '.join(ROUTERS)})")
    top_k = int(getattr(block.gate, "top_k", getattr(block, "top_k", 2)))
    renormalize = True if ROUTERS[router] is None else bool(getattr(block.gate, ROUTERS[router]))
    top_k = top_k if top_k_override is None else top_k_override
    renormalize = renormalize if renormalize_override is None else renormalize_override
    if float(getattr(block, "jitter_noise", 0.0) or 0.0) > 0:
        raise ValueError(f"{name}: router_jitter_noise > 0 is not reproduced; set it to 0")
    shared, shared_gate = getattr(block, "shared_expert", None), getattr(block, "shared_expert_gate", None)
    if getattr(block, "shared_experts", None) is not None or (shared is None) != (shared_gate is None):
        raise ValueError(f"{name}: a shared expert other than Qwen2-MoE's (shared_expert + shared_expert_gate) "
                         "is not mapped")
    if gate_up.shape[0] != num_experts or down.shape[0] != num_experts or gate_up.shape[2] != hidden:
        raise ValueError(f"{name}: gate {tuple(gate_w.shape)}, gate_up_proj {tuple(gate_up.shape)} and down_proj "
                         f"{tuple(down.shape)} do not describe one Mixtral-style expert set")
    intermediate = down.shape[2]
    act = getattr(block.experts, "act_fn", None) or nn.SiLU()
    expert = SwiGLUExpert(hidden, intermediate, act).to(dtype=gate_up.dtype, device=gate_up.device)
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"{name}: top_k={top_k} must be between 1 and the number of experts {num_experts}")
    moe = MoE(hidden, expert, num_experts=num_experts, ep_size=ep_size, k=top_k, drop_tokens=False, use_rts=False,
              top2_2nd_expert_sampling=False, min_capacity=1, renormalize_topk=renormalize, grouped_experts=grouped)
    layer = moe.deepspeed_moe
    with torch.no_grad():
        layer.gate.wg.weight.copy_(gate_w.float())
        for key, mod in layer.experts.deepspeed_experts.items():
            g = int(key)
            mod.gate_up.weight.copy_(gate_up[g])
            mod.down.weight.copy_(down[g])
    return HFMoEBlock(moe, shared, shared_gate).to(device=gate_up.device)


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, block)`` for every HF sparse-MoE block of ``model`` (by structure)."""
    return [(n, m) for n, m in model.named_modules() if _is_hf_moe_block(m)]


def expert_parallel(model: nn.Module, ep_size: int = 1, top_k: int | None = None, renormalize: bool | None = None,
                    grouped: bool = True) -> nn.Module:
    """Replace every HF sparse MoE block of ``model`` in place (see the module docstring).

    ``top_k`` / ``renormalize`` override the model's routing (None: the model's); ``grouped``: the
    local experts as one batched computation (else a loop). Collective when ``ep_size > 1``: every
    rank must call it on the same model. Returns ``model``.
    """
    found = find_blocks(model)
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
            replacement = _convert(name, block, ep_size, top_k, renormalize, grouped)
        setattr(parent, attr, replacement)
    return model


def hf_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (a full state dict of ``model`` in zerospeed's names) with every replaced block's
    entries back in the HF layout: ``<block>.gate.weight`` and the stacked ``<block>.experts.
    gate_up_proj`` ``[E, 2I, H]`` / ``down_proj`` ``[E, H, I]`` (the shared expert keeps its names).
    Entries of a block whose experts are not all in ``state`` are left as they are. Used when the
    engine consolidates weights (``save_pretrained``, ``save_16bit_model``), so the written folder
    loads into the original HF class."""
    blocks = [(n, m) for n, m in model.named_modules() if isinstance(m, HFMoEBlock)]
    if not blocks or not state:
        return state
    out = dict(state)
    for name, block in blocks:
        p = f"{name}.moe.deepspeed_moe." if name else "moe.deepspeed_moe."
        E = block.moe.num_experts
        ups = [out.get(f"{p}experts.deepspeed_experts.{g}.gate_up.weight") for g in range(E)]
        downs = [out.get(f"{p}experts.deepspeed_experts.{g}.down.weight") for g in range(E)]
        gate = out.get(f"{p}gate.wg.weight")
        if gate is None or any(t is None for t in ups + downs):
            continue
        for g in range(E):
            del out[f"{p}experts.deepspeed_experts.{g}.gate_up.weight"], out[f"{p}experts.deepspeed_experts.{g}.down.weight"]
        del out[f"{p}gate.wg.weight"]
        base = f"{name}." if name else ""
        dtype = ups[0].dtype
        out[f"{base}gate.weight"] = gate.to(dtype)
        out[f"{base}experts.gate_up_proj"] = torch.stack(ups)
        out[f"{base}experts.down_proj"] = torch.stack(downs)
    return out
