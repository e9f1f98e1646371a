"""``expert_parallel``: DeepSpeed's AutoEP section (``enabled``, ``autoep_size``, ``preset_model``...).

With ``enabled: true``, ``zerospeed.initialize`` replaces every HF sparse-MoE block of the model by
zerospeed's expert-parallel layer with its experts spread over ``autoep_size`` ranks (see
:mod:`zerospeed.moe.autoep`). Keys read:

* ``autoep_size`` (default 1): the expert-parallel degree; it must divide the data-parallel size
  (checked when the groups are built, naming the sizes);
* ``preset_model``: one of ``mixtral``, ``qwen2_moe``, ``qwen3_moe``, ``olmoe``; when given, every
  block's router must be that family's (an error names the block otherwise). DeepSpeed's other
  presets (``deepseek_v2``, ``deepseek_v3``, ``minimax_m3``, ``qwen3_5_moe``) route differently
  and are refused by name;
* ``top_k`` (``"auto"``: the model's) and ``route_norm`` (null: the model's; true / false: the kept
  experts' weights are / are not renormalised) override the routing;
* ``use_grouped_mm`` (default true): the local experts run as one batched computation, or as a loop.

Every other DeepSpeed AutoEP key is accepted at its DeepSpeed default only (GPU kernels,
communication backends, custom module patterns, expert tensor parallelism, grouped routing): a
different value is an error naming the key, never silently ignored. ``load_balance_coeff`` must be
null, as in DeepSpeed 0.19.8.
"""

from __future__ import annotations

from typing import Any

from pydantic import model_validator

from .fields import Bool, PosInt, Section, Str, fail

PRESETS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
DEEPSPEED_ONLY_PRESETS = ("deepseek_v2", "deepseek_v3", "minimax_m3", "qwen3_5_moe")

#: DeepSpeed AutoEP keys zerospeed accepts at their DeepSpeed default value only
DEFAULT_ONLY: dict[str, Any] = {
    "expert_tensor_parallel_size": 1, "validate_folding_routing": False, "async_split_plan": False,
    "moe_layer_pattern": None, "expert_pattern": None, "router_pattern": None,
    "disable_triton_grouped_mm": False, "route_scale": 1.0, "score_apply": "auto", "combine_impl": "auto",
    "row_weighting_impl": "auto", "gate_up_impl": "separate", "comm_backend": "comm", "comm_num_sm": 12,
    "comm_qp_margin": 4, "comm_max_tokens_per_rank": 0, "num_expert_groups": None, "num_limited_groups": None,
    "score_func": "auto", "load_balance_coeff": None, "routed_scaling_factor": "auto", "expert_w1": None,
    "expert_w2": None, "expert_w3": None, "num_experts_attr": None, "top_k_attr": None,
    "has_shared_experts": None, "shared_experts_pattern": None, "shared_experts_gate_pattern": None,
    "expert_activation": None,
}


class ExpertParallelConfig(Section):
    enabled: Bool = False
    autoep_size: PosInt = 1
    preset_model: Str | None = None
    top_k: Any = "auto"
    route_norm: Bool | None = None
    use_grouped_mm: Bool = True
    expert_tensor_parallel_size: Any = 1
    validate_folding_routing: Any = False
    async_split_plan: Any = False
    moe_layer_pattern: Any = None
    expert_pattern: Any = None
    router_pattern: Any = None
    disable_triton_grouped_mm: Any = False
    route_scale: Any = 1.0
    score_apply: Any = "auto"
    combine_impl: Any = "auto"
    row_weighting_impl: Any = "auto"
    gate_up_impl: Any = "separate"
    comm_backend: Any = "comm"
    comm_num_sm: Any = 12
    comm_qp_margin: Any = 4
    comm_max_tokens_per_rank: Any = 0
    num_expert_groups: Any = None
    num_limited_groups: Any = None
    score_func: Any = "auto"
    load_balance_coeff: Any = None
    routed_scaling_factor: Any = "auto"
    expert_w1: Any = None
    expert_w2: Any = None
    expert_w3: Any = None
    num_experts_attr: Any = None
    top_k_attr: Any = None
    has_shared_experts: Any = None
    shared_experts_pattern: Any = None
    shared_experts_gate_pattern: Any = None
    expert_activation: Any = None

    @model_validator(mode="after")
    def _check(self) -> "ExpertParallelConfig":
        if self.preset_model is not None and self.preset_model not in PRESETS:
            why = (" (DeepSpeed's preset; its router scores experts differently from zerospeed's gate)"
                   if self.preset_model in DEEPSPEED_ONLY_PRESETS else "")
            raise fail(f"{self.preset_model!r} is not supported{why}; supported: {', '.join(PRESETS)}",
                       key="preset_model")
        k = self.top_k
        if k != "auto" and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise fail(f"{k!r} is not 'auto' or a positive integer", key="top_k")
        for key, default in DEFAULT_ONLY.items():
            value = getattr(self, key)
            if value != default or type(value) is not type(default) and not (
                    isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool)):
                raise fail(f"{value!r} is not supported by zerospeed's AutoEP (only DeepSpeed's default "
                           f"{default!r})", key=key)
        return self
