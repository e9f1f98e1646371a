"""``zerospeed.initialize``: DeepSpeed's entry point, wiring config, optimizer, scheduler and engine."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from zerospeed import comm
from zerospeed.config import ConfigError, ZeroSpeedConfig, load_config
from zerospeed.runtime.dataloader import build_dataloader
from zerospeed.runtime.engine import ZeroSpeedEngine


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


def optimizer_from_config(cfg: ZeroSpeedConfig, optimizer: Any, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """The optimizer from the config section or the client's (instance or callable), never both."""
    from zerospeed.ops.optimizers import build_optimizer, resolve_client_optimizer

    if optimizer is not None and cfg.optimizer is not None:
        raise ConfigError("optimizer", "an optimizer is given both in the config and as initialize(optimizer=...); "
                          "keep one")
    if optimizer is not None:
        return resolve_client_optimizer(optimizer, groups)
    if cfg.optimizer is None:
        raise ConfigError("optimizer", "no optimizer: set 'optimizer' in the config or pass initialize(optimizer=...)")
    from zerospeed.runtime.fast_paths import quiet_choices

    with quiet_choices():  # a forced adam_kernel is reported in the engine's start-up line
        return build_optimizer(cfg.optimizer.type, cfg.optimizer.params, groups, cfg.fast_paths)


def scheduler_from_config(cfg: ZeroSpeedConfig, lr_scheduler: Any, optimizer: torch.optim.Optimizer) -> Any:
    """The lr scheduler from the config section or the client's (instance or callable), or None."""
    from zerospeed.runtime.lr_schedules import build_lr_scheduler

    if lr_scheduler is not None and cfg.scheduler is not None:
        raise ConfigError("scheduler", "a scheduler is given both in the config and as initialize(lr_scheduler=...); "
                          "keep one")
    if lr_scheduler is not None:
        return lr_scheduler(optimizer) if callable(lr_scheduler) and not hasattr(lr_scheduler, "step") else lr_scheduler
    if cfg.scheduler is None:
        return None
    return build_lr_scheduler(cfg.scheduler.type, cfg.scheduler.params, optimizer)


def initialize(args: Any = None, model: nn.Module | None = None, optimizer: Any = None,
               model_parameters: Iterable[Any] | None = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = 29500, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Callable[..., Any] | None = None, config: Any = None, config_params: Any = None,
               mesh_param: Any = None) -> tuple[ZeroSpeedEngine, torch.optim.Optimizer, Any, Any]:
    """Build the training engine. Returns ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    ``config`` is a DeepSpeed config dict or JSON path (``config_params`` and
    ``args.deepspeed_config`` are accepted as DeepSpeed does). The optimizer comes from the config
    or from ``optimizer`` (an instance built over the model's parameters, or a callable taking
    parameter groups); the scheduler likewise. Tensor parallelism (``tensor_parallel.autotp_size``, a
    Megatron-style ``mpu``, or ``mesh_param={"pp":, "dp":, "tp":}``) builds the (pp, dp, tp) mesh
    first and splits the model with AutoTP (see :mod:`zerospeed.runtime.tp_setup`).
    """
    del dist_init_required
    if model is None or not isinstance(model, nn.Module):
        raise TypeError(f"initialize: model must be a torch.nn.Module, got {type(model).__name__}")
    raw = config if config is not None else config_params
    if args is not None:
        from zerospeed.arguments import config_path_from_args

        from_args = config_path_from_args(args)
        if raw is not None and from_args is not None:  # DeepSpeed refuses this too
            raise ValueError("initialize: a config is given both as --deepspeed_config on the command line and as "
                             "initialize(config=...); keep one")
        raw = raw if raw is not None else from_args
    if raw is None:
        raise ConfigError("", "no config: pass initialize(config=<dict or path to a DeepSpeed JSON file>)")
    comm.init_distributed(distributed_port=distributed_port)
    from zerospeed.pipe.module import PipelineModule

    if isinstance(model, PipelineModule):
        from zerospeed.pipe.engine import initialize_pipeline

        from zerospeed.runtime import tp_setup

        mesh, tp_cfg = tp_setup.mesh_for(raw, mpu=mpu, mesh_param=mesh_param, pp=model.topology().get_dim("pipe"))
        from zerospeed.moe.autoep import refuse_with_pipeline

        refuse_with_pipeline(raw)
        return initialize_pipeline(model, raw, optimizer=optimizer, model_parameters=model_parameters,
                                   training_data=training_data, lr_scheduler=lr_scheduler, collate_fn=collate_fn,
                                   mesh=mesh, tp_config=tp_cfg)
    from zerospeed.runtime import tp_setup

    mesh, tp_cfg = tp_setup.mesh_for(raw, mpu=mpu, mesh_param=mesh_param, model=model)
    dp_world_size = comm.get_world_size() if mesh is None else mesh.dp_size
    dp_rank = comm.get_rank() if mesh is None else mesh.dp_rank
    cfg = load_config(raw, dp_world_size=dp_world_size)
    device = comm.device_for_backend()
    model.to(device)
    if mesh is not None:
        model = tp_setup.prepare_model(model, mesh, tp_cfg, optimizer)
    from zerospeed.moe.autoep import apply_autoep  # expert_parallel.enabled: HF MoE blocks -> expert parallel

    model = apply_autoep(model, cfg.expert_parallel)
    groups = param_groups_of(model, model_parameters)
    opt = optimizer_from_config(cfg, optimizer, groups)
    engine = ZeroSpeedEngine(model, cfg, opt, dp_group=None if mesh is None else mesh.dp_group)
    if mesh is not None:
        tp_setup.attach(engine, mesh)
    engine.lr_scheduler = scheduler_from_config(cfg, lr_scheduler, opt)
    loader = None
    if training_data is not None:
        loader = build_dataloader(training_data, cfg.train_micro_batch_size_per_gpu, dp_rank, dp_world_size,
                                  collate_fn=collate_fn, drop_last=cfg.dataloader_drop_last, seed=cfg.seed or 0)
    engine.training_dataloader = loader  # its position is saved and restored with the engine's checkpoints
    return engine, opt, loader, engine.lr_scheduler
