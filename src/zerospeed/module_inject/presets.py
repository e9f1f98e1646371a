"""Built-in layer specs per model family (``tensor_parallel.preset_model``, DeepSpeed's preset names).

Each preset is a list of ``(regex, partition_type, fused)`` rules matched against module names
(``re.match``, as DeepSpeed matches parameter names). ``fused`` names how a column layer packs
sub-projections: ``None`` (one projection, or per-head interleaved as in NeoX/Bloom
``query_key_value``), an int (that many equal parts) or ``"qkv"`` (q, k, v sizes from the model
config: heads x head_dim, KV heads x head_dim twice).
"""

from __future__ import annotations

from typing import Any

Rule = tuple[str, str, Any]

_LLAMA: list[Rule] = [
    (r".*\.(self_attn|attention)\.[qkv]_proj$", "column", None),
    (r".*\.(self_attn|attention)\.o_proj$", "row", None),
    (r".*\.mlp\.(gate|up)_proj$", "column", None),
    (r".*\.mlp\.down_proj$", "row", None),
]

PRESETS: dict[str, list[Rule]] = {
    "llama": _LLAMA,
    "qwen2": _LLAMA,
    "mixtral": [
        (r".*\.self_attn\.[qkv]_proj$", "column", None),
        (r".*\.self_attn\.o_proj$", "row", None),
        (r".*\.block_sparse_moe\.gate$", "skip", None),
        (r".*\.experts\.\d+\.w[13]$", "column", None),
        (r".*\.experts\.\d+\.w2$", "row", None),
    ],
    "phi3": [
        (r".*\.self_attn\.qkv_proj$", "column", "qkv"),
        (r".*\.self_attn\.o_proj$", "row", None),
        (r".*\.mlp\.gate_up_proj$", "column", 2),
        (r".*\.mlp\.down_proj$", "row", None),
    ],
    "bloom": [
        (r".*\.self_attention\.query_key_value$", "column", None),
        (r".*\.self_attention\.dense$", "row", None),
        (r".*\.mlp\.dense_h_to_4h$", "column", None),
        (r".*\.mlp\.dense_4h_to_h$", "row", None),
    ],
    "chatglm": [
        (r".*\.self_attention\.query_key_value$", "column", "qkv"),
        (r".*\.self_attention\.dense$", "row", None),
        (r".*\.mlp\.dense_h_to_4h$", "column", 2),
        (r".*\.mlp\.dense_4h_to_h$", "row", None),
    ],
    "deepseek_v2": [
        (r".*\.self_attn\.(q_proj|q_b_proj|kv_b_proj)$", "column", None),
        (r".*\.self_attn\.o_proj$", "row", None),
        (r".*\.mlp\.gate$", "skip", None),
        (r".*\.mlp\.(shared_experts\.|experts\.\d+\.)?(gate|up)_proj$", "column", None),
        (r".*\.mlp\.(shared_experts\.|experts\.\d+\.)?down_proj$", "row", None),
    ],
    "gpt2": [
        (r".*\.attn\.c_attn$", "column", 3),
        (r".*\.attn\.c_proj$", "row", None),
        (r".*\.mlp\.c_fc$", "column", None),
        (r".*\.mlp\.c_proj$", "row", None),
    ],
    "gpt_neox": [
        (r".*\.attention\.query_key_value$", "column", None),
        (r".*\.attention\.dense$", "row", None),
        (r".*\.mlp\.dense_h_to_4h$", "column", None),
        (r".*\.mlp\.dense_4h_to_h$", "row", None),
    ],
    "opt": [
        (r".*\.self_attn\.[qkv]_proj$", "column", None),
        (r".*\.self_attn\.out_proj$", "row", None),
        (r".*\.fc1$", "column", None),
        (r".*\.fc2$", "row", None),
    ],
}
