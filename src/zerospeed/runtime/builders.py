"""The optimizer, its parameter groups and the lr scheduler of an engine, from the parsed config or the client's.

Shared by :func:`zerospeed.initialize` (the facade) and the pipeline engine's set-up
(:func:`zerospeed.pipe.engine.initialize_pipeline`), so they live below both: the pipeline engine no longer
imports the facade that dispatches to it.

No optimizer at all (none passed, no ``optimizer`` section) builds an engine for forward and evaluation, as DeepSpeed
0.19.8 does: its engine keeps ``optimizer=None`` at stage 0 and partitions the parameters of a ZeRO-3 model without an
optimizer (what TRL's reference and reward models rely on). zerospeed's engine then holds a :class:`NoOptimizer`: it
holds no parameter, so the ZeRO strategies treat every parameter as one nobody trains (stage 3 still partitions and
gathers them for the forward; no gradient buffer, fp32 master or optimizer state is allocated), and
``engine.backward`` / ``engine.step`` refuse in one line, where DeepSpeed asserts "must provide optimizer during init".
Decisions: DeepSpeed refuses stages 1 and 2 without an optimizer ("zero stage N requires an optimizer"); zerospeed
builds the same forward engine there (the parameters are replicated at those stages, so there is nothing to refuse).
DeepSpeed ignores a ``scheduler`` section when there is no optimizer; zerospeed refuses it (a schedule with no
optimizer to drive is a config mistake).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from zerospeed.config import ConfigError, ZeroSpeedConfig


def param_groups_of(model: nn.Module, model_parameters: Iterable[Any] | None) -> list[dict[str, Any]]:
    """Parameter groups from ``model_parameters`` (tensors, named tensors or group dicts), or the
    model's trainable parameters as one group. A model with mixture-of-experts layers gets its
    expert parameters in groups of their own (as DeepSpeed's engine does), since they are reduced
    over another process group."""
    groups = _param_groups(model, model_parameters)
    from zerospeed.moe.groups import model_has_experts

    if model_has_experts(model):
        from zerospeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        groups = [g for g in split_params_into_different_moe_groups_for_optimizer(groups) if g["params"]]
    return groups


def _param_groups(model: nn.Module, model_parameters: Iterable[Any] | None) -> list[dict[str, Any]]:
    if model_parameters is None:
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        return [dict(g, params=list(g["params"])) for g in items]
    if items and isinstance(items[0], tuple):  # named_parameters()
        items = [p for _, p in items]
    return [{"params": [p for p in items if p.requires_grad]}]


NO_OPTIMIZER = ("this engine was built without an optimizer (initialize() got none and the config has no "
                "'optimizer' section), for forward and evaluation only; pass initialize(optimizer=...) or add an "
                "'optimizer' section to train")


class NoOptimizer:
    """The optimizer of an engine built without one: no parameter groups, no state, and ``step()`` refuses.

    It is what the strategies see in the optimizer's place (every parameter is then one nobody trains), not a
    stand-in that pretends to train: ``initialize`` returns ``None`` in the optimizer's slot."""

    def __init__(self) -> None:
        self.param_groups: list[dict[str, Any]] = []
        self.state: dict[Any, Any] = {}
        self.defaults: dict[str, Any] = {}

    def step(self, closure: Any = None) -> None:
        raise RuntimeError(f"optimizer.step: {NO_OPTIMIZER}")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to clear: no parameter is held."""

    def state_dict(self) -> dict[str, Any]:
        return {"state": {}, "param_groups": []}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("state") or state_dict.get("param_groups"):
            raise ValueError(f"load_state_dict: the saved optimizer state has groups, but {NO_OPTIMIZER}")


def optimizer_from_config(cfg: ZeroSpeedConfig, optimizer: Any, groups: list[dict[str, Any]],
                          model: nn.Module | None = None) -> torch.optim.Optimizer | NoOptimizer:
    """The client's optimizer (instance or callable) if given, else the config section's.

    Given both, the client's is used and the config's section is named in a warning, as DeepSpeed 0.19.8
    does (its engine builds from the config only without a client optimizer; it logs which one it uses).
    ``model`` gives the parameter names that Muon's tagging reads (embeddings and the LM head to Adam)."""
    from zerospeed.ops.optimizers import build_optimizer, resolve_client_optimizer

    if optimizer is not None:
        if cfg.optimizer is not None:
            _ignored_section("optimizer", cfg.optimizer.type, "initialize(optimizer=...)")
        return resolve_client_optimizer(optimizer, groups)
    if cfg.optimizer is None:
        return NoOptimizer()  # an engine for forward and evaluation (module docstring)
    from zerospeed.runtime.fast_paths import quiet_choices

    with quiet_choices():  # a forced adam_kernel is reported in the engine's start-up line
        names = {id(p): n for n, p in model.named_parameters()} if model is not None else None
        return build_optimizer(cfg.optimizer.type, cfg.optimizer.params, groups, cfg.fast_paths, names=names,
                               shapes=_layer_shapes(model))


def _layer_shapes(model: nn.Module | None) -> dict[int, tuple[int, ...]]:
    """``id(param) -> shape`` for parameters zero.Init partitioned (their own shape is a placeholder's),
    so Muon tags them by the layer's shape (DeepSpeed #8438: under zero.Init none were tagged)."""
    if model is None:
        return {}
    from zerospeed.zero.stage3 import registry

    shapes = {}
    for p in model.parameters():
        found = registry.lookup(p)
        if found is not None:
            bucket, index = found
            shapes[id(p)] = tuple(bucket.layout.slots[index].shape)
    return shapes


def _ignored_section(key: str, kind: str, argument: str) -> None:
    import logging

    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        logging.getLogger("zerospeed").warning(
            "zerospeed: %s is used; the config's '%s' section (type %s) is ignored, as DeepSpeed ignores it",
            argument, key, kind)


def scheduler_from_config(cfg: ZeroSpeedConfig, lr_scheduler: Any, optimizer: Any) -> Any:
    """The lr scheduler from the config section or the client's (instance or callable), or None."""
    from zerospeed.runtime.lr_schedules import build_lr_scheduler

    if isinstance(optimizer, NoOptimizer) and (lr_scheduler is not None or cfg.scheduler is not None):
        raise ConfigError("scheduler", "a learning-rate scheduler needs an optimizer to drive, and there is none "
                          "(no 'optimizer' section, no initialize(optimizer=...)); add one or drop the scheduler")

    if lr_scheduler is not None:
        if cfg.scheduler is not None:  # DeepSpeed 0.19.8 likewise uses the client's
            _ignored_section("scheduler", cfg.scheduler.type, "initialize(lr_scheduler=...)")
        return lr_scheduler(optimizer) if callable(lr_scheduler) and not hasattr(lr_scheduler, "step") else lr_scheduler
    if cfg.scheduler is None:
        return None
    return build_lr_scheduler(cfg.scheduler.type, cfg.scheduler.params, optimizer)


__all__ = ["NO_OPTIMIZER", "NoOptimizer", "optimizer_from_config", "param_groups_of", "scheduler_from_config"]
