"""``ZeroSpeedTrainer``: the HuggingFace ``Trainer`` training on a zerospeed engine.

Usage: replace ``Trainer(..., args=TrainingArguments(..., deepspeed="ds.json"))`` by
``ZeroSpeedTrainer(..., args=TrainingArguments(...), ds_config="ds.json")`` and launch with torchrun
(or ``zerospeed``) as before. ``TrainingArguments(deepspeed=...)`` itself cannot be used: it makes
transformers import the real DeepSpeed. HF's ``"auto"`` values are filled from the arguments
(:mod:`zerospeed.config.hf_auto`).

How it plugs in (only public/overridable methods of ``Trainer``; nothing of transformers or
Accelerate is replaced):

* ``_wrap_model`` (the Trainer's hook for wrapping the model for distributed training) builds the
  engine with ``zerospeed.initialize`` on the first training call and returns it. Because the
  returned model is not ``self.model``, the Trainer does not let Accelerate wrap it in DDP.
  Optimizer: the config's ``optimizer`` section if present, else the one ``create_optimizer`` built
  (HF's weight-decay groups either way). Scheduler: the config's ``scheduler`` (stepped by the engine)
  if present, else HF's ``create_scheduler`` on ``self.optimizer``.
* ``self.optimizer`` becomes :class:`EngineOptimizer`: it shares the engine optimizer's
  ``param_groups`` (an HF scheduler's lr reaches the engine) and its ``step`` / ``zero_grad`` do
  nothing (the engine steps).
* ``create_accelerator_and_postprocess`` wraps the Accelerator in :class:`EngineAccelerator`, a
  delegating object whose ``backward`` runs ``engine.backward(loss)`` then ``engine.step()`` (the
  DeepSpeed contract: step after every micro-batch, update at the accumulation boundary),
  ``clip_grad_norm_`` reports the engine's gradient norm (clipping is the engine's, from
  ``gradient_clipping`` = ``max_grad_norm``), ``no_sync`` is a no-op and ``unwrap_model`` /
  ``get_state_dict`` know the engine.
* Saving: ``save_model`` consolidates the weights (a collective) and writes an HF folder on rank 0
  (``from_pretrained`` loads it). At stage 3 without ``stage3_gather_16bit_weights_on_model_save``
  it writes the engine checkpoint instead, as the HF/DeepSpeed integration does. Checkpoints:
  ``_save_optimizer_and_scheduler`` writes the engine's sharded checkpoint under
  ``checkpoint-N/zerospeed``; ``resume_from_checkpoint`` loads it back (weights, optimizer, scheduler).

The loss the Trainer computes is already divided for gradient accumulation (or normalised by
``num_items_in_batch``), so the engine's own division is off (``scale_wrt_gas=False``), as HF does
for DeepSpeed. Accumulation must then agree: the engine's ``gradient_accumulation_steps`` is the
Trainer's, and an epoch whose micro-batches per rank are not a multiple of it (the Trainer would step
on a short window at the epoch's end) is refused at that point with an error saying so.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from transformers import Trainer

import zerospeed
from zerospeed import comm
from zerospeed.config.hf_auto import fill_auto, read_config

ENGINE_CHECKPOINT_DIR = "zerospeed"
SCHEDULER_NAME = "scheduler.pt"


class EngineOptimizer(torch.optim.Optimizer):
    """What the Trainer holds as ``self.optimizer``: the engine's parameter groups, no step of its own."""

    def __init__(self, engine: Any) -> None:  # no super().__init__: the groups are the engine optimizer's
        self.engine = engine
        self._optimizer_step_pre_hooks: dict[int, Any] = {}
        self._optimizer_step_post_hooks: dict[int, Any] = {}
        self._optimizer_load_state_dict_pre_hooks: dict[int, Any] = {}
        self._optimizer_load_state_dict_post_hooks: dict[int, Any] = {}
        self._optimizer_state_dict_pre_hooks: dict[int, Any] = {}
        self._optimizer_state_dict_post_hooks: dict[int, Any] = {}

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.engine.optimizer.param_groups

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.engine.optimizer.defaults

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.engine.optimizer.state

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None  # the engine stepped in backward (at the accumulation boundary)

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("the optimizer state is sharded by zerospeed: it is saved with engine.save_checkpoint "
                           "(ZeroSpeedTrainer does so in each checkpoint)")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise RuntimeError("the optimizer state is sharded by zerospeed: load it with engine.load_checkpoint")

    def __repr__(self) -> str:
        return f"EngineOptimizer({type(self.engine.optimizer).__name__}, zero stage {self.engine.zero_stage})"


class _ConfigScheduler:
    """The Trainer's view of a scheduler the engine steps itself (a config ``scheduler`` section)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def get_last_lr(self) -> list[float]:
        return self.engine.get_lr()

    def state_dict(self) -> dict[str, Any]:
        return {}  # in the engine checkpoint

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


class EngineAccelerator:
    """Delegates to the Trainer's Accelerator, except where the zerospeed engine takes over."""

    def __init__(self, accelerator: Any, trainer: "ZeroSpeedTrainer") -> None:
        object.__setattr__(self, "_accelerator", accelerator)
        object.__setattr__(self, "_trainer", trainer)
        object.__setattr__(self, "_skipped_before", 0)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_accelerator"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._accelerator, name, value)

    @property
    def _engine(self) -> Any:
        return self._trainer.zerospeed_engine

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        engine = self._engine
        if engine is None:
            return self._accelerator.backward(loss, **kwargs)
        sync = bool(self._accelerator.gradient_state.sync_gradients)
        if sync != engine.is_gradient_accumulation_boundary():
            raise RuntimeError(
                "ZeroSpeedTrainer: the Trainer ends an accumulation window after a number of micro-batches that is "
                f"not gradient_accumulation_steps ({engine.gradient_accumulation_steps()}): an epoch's micro-batches "
                "per rank are not a multiple of it, and the zerospeed engine steps only every "
                "gradient_accumulation_steps micro-batches. Make the per-rank batches per epoch a multiple of "
                "gradient_accumulation_steps (dataset size, dataloader_drop_last) or use gradient_accumulation_steps 1")
        object.__setattr__(self, "_skipped_before", engine.skipped_steps)
        engine.backward(loss, scale_wrt_gas=False)
        engine.step()
        return None

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        engine = self._engine
        if engine is None:
            return self._accelerator.clip_grad_norm_(parameters, max_norm, norm_type)
        norm = engine.get_global_grad_norm()
        return torch.tensor(float("nan") if norm is None else float(norm))

    def no_sync(self, model: Any = None) -> Any:
        if self._engine is not None:
            return contextlib.nullcontext()
        return self._accelerator.no_sync(model)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        engine = self._engine
        if engine is None:
            return self._accelerator.optimizer_step_was_skipped
        return engine.skipped_steps > self._skipped_before

    def prepare(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and isinstance(args[0], EngineOptimizer):
            return args[0]
        return self._accelerator.prepare(*args, **kwargs)

    def unwrap_model(self, model: Any, *args: Any, **kwargs: Any) -> Any:
        engine = self._engine
        if engine is not None and model is engine:
            return engine.module
        return self._accelerator.unwrap_model(model, *args, **kwargs)

    def get_state_dict(self, model: Any, unwrap: bool = True) -> Any:
        engine = self._engine
        if engine is not None and model in (engine, engine.module):
            return engine.consolidated_state_dict()
        return self._accelerator.get_state_dict(model, unwrap=unwrap)


class ZeroSpeedTrainer(Trainer):
    """A drop-in ``transformers.Trainer`` that trains with zerospeed (see the module docstring).

    ``ds_config``: the DeepSpeed config (dict or JSON path), HF ``"auto"`` values allowed.
    """

    def __init__(self, *args: Any, ds_config: Any = None, **kwargs: Any) -> None:
        if ds_config is None:
            raise ValueError("ZeroSpeedTrainer: ds_config is required (the DeepSpeed config: a dict or a JSON path; "
                             "pass it here instead of TrainingArguments(deepspeed=...))")
        self.ds_config_raw = read_config(ds_config)
        self.zerospeed_engine: Any = None
        super().__init__(*args, **kwargs)
        if getattr(self.args, "deepspeed", None):
            raise ValueError("ZeroSpeedTrainer: leave TrainingArguments.deepspeed unset; the config goes in ds_config")

    # -- accelerator -------------------------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        self.accelerator = EngineAccelerator(self.accelerator, self)  # type: ignore[assignment]

    # -- the engine --------------------------------------------------------------------------------
    def _wrap_model(self, model: Any, training: bool = True, dataloader: Any = None) -> Any:
        if self.zerospeed_engine is not None:
            return self.zerospeed_engine
        if not training:
            return super()._wrap_model(model, training=training, dataloader=dataloader)
        self.zerospeed_engine = self._build_engine()
        return self.zerospeed_engine

    def _build_engine(self) -> Any:
        comm.init_distributed()
        world = comm.get_world_size()
        hidden = getattr(getattr(self.model, "config", None), "hidden_size", None)
        cfg = fill_auto(self.ds_config_raw, self.args, self.state.max_steps, world, hidden)
        groups = self._param_groups()
        optimizer = None if "optimizer" in cfg else self.optimizer
        if optimizer is None:
            self.optimizer = None  # the engine builds the config's optimizer over HF's groups
        lr_scheduler = None
        if "scheduler" not in cfg and self.lr_scheduler is not None:
            lr_scheduler = self.lr_scheduler
        engine, _, _, _ = zerospeed.initialize(model=self.model, optimizer=optimizer,
                                               model_parameters=None if optimizer is not None else groups,
                                               lr_scheduler=lr_scheduler, config=cfg)
        self.optimizer = EngineOptimizer(engine)
        if "scheduler" in cfg:
            self.lr_scheduler = _ConfigScheduler(engine)  # type: ignore[assignment]
        return engine

    def _param_groups(self) -> list[dict[str, Any]]:
        decay = set(self.get_decay_parameter_names(self.model))
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        return [g for g in groups if g["params"]]

    # -- saving and resuming -----------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        engine = self.zerospeed_engine
        if engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        zcfg = engine.config.zero_optimization
        if zcfg.stage == 3 and not zcfg.stage3_gather_16bit_weights_on_model_save:
            if self.args.should_save:
                import logging

                logging.getLogger("zerospeed").warning(
                    "zerospeed: stage3_gather_16bit_weights_on_model_save is false: saving the sharded engine "
                    "checkpoint to %s instead of from_pretrained weights", output_dir)
            engine.save_checkpoint(os.path.join(output_dir, ENGINE_CHECKPOINT_DIR))
        else:
            state_dict = engine.consolidated_state_dict()  # every rank: a collective
            self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        engine = self.zerospeed_engine
        if engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        engine.save_checkpoint(os.path.join(output_dir, ENGINE_CHECKPOINT_DIR))
        if self.args.should_save and not isinstance(self.lr_scheduler, _ConfigScheduler):
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self.zerospeed_engine is not None:
            return None  # the engine checkpoint restores the weights (_load_optimizer_and_scheduler)
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        engine = self.zerospeed_engine
        if engine is None or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        folder = os.path.join(checkpoint, ENGINE_CHECKPOINT_DIR)
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"ZeroSpeedTrainer: {checkpoint} holds no zerospeed engine checkpoint "
                                    f"({ENGINE_CHECKPOINT_DIR}/); was it written by ZeroSpeedTrainer?")
        engine.load_checkpoint(folder)
        if not isinstance(self.lr_scheduler, _ConfigScheduler):
            path = os.path.join(checkpoint, SCHEDULER_NAME)
            self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))


__all__ = ["EngineAccelerator", "EngineOptimizer", "ZeroSpeedTrainer"]
