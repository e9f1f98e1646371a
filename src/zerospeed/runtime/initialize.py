"""``zerospeed.initialize``: DeepSpeed's entry point, wiring config, optimizer, scheduler and engine.

This is the facade (the top layer, tests/test_import_structure.py): the config is read here once
(:func:`zerospeed.config.prepare_config`), the mesh is built from its tensor-parallel section (and the
pipeline module's stages, an mpu or ``mesh_param``), the one :class:`~zerospeed.config.ZeroSpeedConfig` is
resolved for the mesh's data-parallel degree, and the typed config is handed to the single-model engine or to
the pipeline engine; nothing below reads the user's dict or file again.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from zerospeed import comm
from zerospeed.config import ConfigError, PreparedConfig, prepare_config
from zerospeed.runtime.builders import NoOptimizer, optimizer_from_config, param_groups_of, scheduler_from_config
from zerospeed.runtime.dataloader import build_dataloader
from zerospeed.runtime.engine import ZeroSpeedEngine


def initialize(args: Any = None, model: nn.Module | None = None, optimizer: Any = None,
               model_parameters: Iterable[Any] | None = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = 29500, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Callable[..., Any] | None = None, config: Any = None, config_params: Any = None,
               mesh_param: Any = None) -> tuple[ZeroSpeedEngine, torch.optim.Optimizer, Any, Any]:
    """Build the training engine. Returns ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    ``config`` is a DeepSpeed config dict or JSON path (``config_params`` and
    ``args.deepspeed_config`` are accepted as DeepSpeed does). The optimizer comes from the config
    or from ``optimizer`` (an instance built over the model's parameters, or a callable taking
    parameter groups); the scheduler likewise. With no optimizer at all the engine is for forward and evaluation
    (as DeepSpeed's; ZeRO-3 still partitions the parameters) and ``None`` is returned in the optimizer's slot. Tensor parallelism (``tensor_parallel.autotp_size``, a
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
    prepared = prepare_config(raw)  # read once; the layers below receive typed sections of the one parsed config
    from zerospeed.pipe.module import PipelineModule
    from zerospeed.runtime import tp_setup
    from zerospeed.runtime.sequence_parallel.setup import sequence_parallel_mesh

    sp_mesh = sequence_parallel_mesh(prepared.section("sequence_parallel_size"), prepared.tensor_parallel, mpu=mpu,
                                     mesh_param=mesh_param, pipeline=isinstance(model, PipelineModule))
    if isinstance(model, PipelineModule):
        return _initialize_pipeline(model, prepared, mpu=mpu, mesh_param=mesh_param, optimizer=optimizer,
                                    model_parameters=model_parameters, training_data=training_data,
                                    lr_scheduler=lr_scheduler, collate_fn=collate_fn)
    built = sp_mesh or tp_setup.mesh_for(prepared.tensor_parallel, mpu=mpu, mesh_param=mesh_param, model=model)
    mesh = built if built is not None else comm.world_mesh()  # no tp, pp or mesh_param: the world is one dp group
    dp_world_size, dp_rank = mesh.dp_size, mesh.dp_rank
    cfg = prepared.resolve(dp_world_size)
    _check_expert_degree(cfg, mesh)
    device = comm.device_for_backend()
    model.to(device)
    if built is not None:
        model = tp_setup.prepare_model(model, mesh, cfg.tensor_parallel, optimizer)
    from zerospeed.moe.autoep import apply_autoep  # expert_parallel.enabled: HF MoE blocks -> expert parallel

    model = apply_autoep(model, cfg.expert_parallel)
    groups = param_groups_of(model, model_parameters)
    opt = optimizer_from_config(cfg, optimizer, groups, model)
    engine = ZeroSpeedEngine(model, cfg, opt, dp_group=mesh.sp_dp_group)  # ZeRO over dp x sp (sp ranks: same weights)
    if built is not None:
        tp_setup.attach(engine, mesh)
    engine.lr_scheduler = scheduler_from_config(cfg, lr_scheduler, opt)
    loader = None
    if training_data is not None:
        loader = build_dataloader(training_data, cfg.train_micro_batch_size_per_gpu, dp_rank, dp_world_size,
                                  collate_fn=collate_fn, drop_last=cfg.dataloader_drop_last, seed=cfg.seed or 0)
        loader.sp_shared_samples = mesh.sp_size > 1  # every sp rank of a group reads the same samples
    engine.training_dataloader = loader  # its position is saved and restored with the engine's checkpoints
    from zerospeed import rl  # engine.generate / engine.sync_weights (hybrid_engine; issue #32)

    engine.rl = rl.attach(engine, cfg)
    return engine, (None if isinstance(opt, NoOptimizer) else opt), loader, engine.lr_scheduler


def _initialize_pipeline(model: Any, prepared: PreparedConfig, *, mpu: Any, mesh_param: Any,
                         **kwargs: Any) -> tuple[Any, torch.optim.Optimizer, Any, Any]:
    """``initialize`` for a ``PipelineModule``: the mesh (pp from the module), the checks that come before the
    config is resolved (AutoEP refused, the module's topology against the world), the config for the pipeline's
    data-parallel degree, then :func:`zerospeed.pipe.engine.initialize_pipeline`."""
    from zerospeed.moe.autoep import refuse_with_pipeline
    from zerospeed.pipe.engine import initialize_pipeline
    from zerospeed.pipe.runtime_setup import check_topology
    from zerospeed.runtime import tp_setup

    num_pp = model.topology().get_dim("pipe")
    mesh = tp_setup.mesh_for(prepared.tensor_parallel, mpu=mpu, mesh_param=mesh_param, pp=num_pp)
    refuse_with_pipeline(prepared.section("expert_parallel"))
    world_size = comm.get_world_size()
    check_topology(model, world_size)
    tp_size = 1 if mesh is None else mesh.tp_size
    cfg = prepared.resolve(world_size // tp_size // num_pp)
    return initialize_pipeline(model, cfg, mesh=mesh, **kwargs)


def _check_expert_degree(cfg: Any, mesh: Any) -> None:
    """AutoEP's degree against the mesh, before anything is built (the mesh carves its expert groups out of
    the dp groups, so ``expert_parallel.autoep_size`` must divide the dp degree)."""
    if cfg.expert_parallel.enabled:
        try:
            mesh.validate_expert_degree(cfg.expert_parallel.autoep_size)
        except ValueError as exc:
            raise ConfigError("expert_parallel.autoep_size", str(exc)) from None
