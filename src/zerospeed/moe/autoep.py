"""AutoEP from the config: ``expert_parallel.enabled`` makes ``zerospeed.initialize`` replace the
model's HF sparse-MoE blocks with zerospeed's expert-parallel layer (:func:`zerospeed.moe.hf.
expert_parallel`) before the engine is built, so a DeepSpeed AutoEP config trains unchanged.

Decisions: ``preset_model`` names the router family every block must have (the blocks are found by
structure whatever it says; it is a check, as a preset is an expectation about the model);
``top_k`` / ``route_norm`` override the model's routing; ``use_grouped_mm`` picks grouped experts or
the loop. A pipeline model with AutoEP is refused (its stages are built by the pipeline engine).
"""

from __future__ import annotations

from typing import Any

from torch import nn

#: preset_model -> the HF router class of that family
PRESET_ROUTERS = {"mixtral": "MixtralTopKRouter", "qwen2_moe": "Qwen2MoeTopKRouter",
                  "qwen3_moe": "Qwen3MoeTopKRouter", "olmoe": "OlmoeTopKRouter"}


def apply_autoep(model: nn.Module, cfg: Any) -> nn.Module:
    """``model`` with its MoE blocks replaced when ``cfg.enabled`` (``cfg``: ExpertParallelConfig)."""
    if not cfg.enabled:
        return model
    from zerospeed.config.errors import ConfigError
    from zerospeed.moe.hf import expert_parallel, find_blocks

    blocks = find_blocks(model)
    if not blocks:
        raise ConfigError("expert_parallel.enabled", f"true, but {type(model).__name__} has no HF sparse-MoE block "
                          "(gate.weight [E, H], experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I])")
    if cfg.preset_model is not None:
        want = PRESET_ROUTERS[cfg.preset_model]
        for name, block in blocks:
            if type(block.gate).__name__ != want:
                raise ConfigError("expert_parallel.preset_model",
                                  f"{cfg.preset_model!r} expects {want} routers, but {name} has "
                                  f"{type(block.gate).__name__}")
    return expert_parallel(model, cfg.autoep_size, top_k=None if cfg.top_k == "auto" else int(cfg.top_k),
                           renormalize=cfg.route_norm, grouped=cfg.use_grouped_mm)


def refuse_with_pipeline(section: Any) -> None:
    """A pipeline model cannot take AutoEP: raise ConfigError when ``expert_parallel.enabled``.

    ``section`` is the parsed ``expert_parallel`` section (what ``initialize`` passes), or a whole config
    (dict, JSON path or parsed config) whose section the config parser reads; a config it cannot read is left
    to the pipeline engine's parse to report.
    """
    from zerospeed.config.errors import ConfigError
    from zerospeed.config.expert_parallel import ExpertParallelConfig

    if not isinstance(section, ExpertParallelConfig):
        from zerospeed.config.loader import load_section

        try:
            section = load_section(section, "expert_parallel")
        except ConfigError:
            return
    if section.enabled:
        raise ConfigError("expert_parallel.enabled", "AutoEP is not supported with a PipelineModule yet; use "
                          "zerospeed.moe.layer.MoE layers inside the pipeline stages instead")
