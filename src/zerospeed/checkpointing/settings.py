"""``configure`` / ``is_configured`` / ``reset``: the process-wide activation-checkpointing settings.

DeepSpeed keeps these as module globals set by ``deepspeed.checkpointing.configure``; so do we, in
one frozen :class:`Settings` object. ``configure(mpu_, deepspeed_config=...)`` reads the
``activation_checkpointing`` section of a DeepSpeed config (dict, JSON path or parsed
:class:`~zerospeed.config.ZeroSpeedConfig`); explicit keyword arguments override it.
``checkpoint()`` works unconfigured (plain recomputation, DeepSpeed's defaults).

Decisions:

* The tensor-parallel group for ``partition_activations`` is the mpu's model-parallel group when
  an mpu is given, else the current mesh's (:func:`zerospeed.comm.mesh.get_mesh`) looked up at
  each checkpoint (the mesh may be built after ``configure``); a TP degree of 1 makes
  partitioning a no-op.
* ``contiguous_checkpointing`` (DeepSpeed: requires ``partition_activations``; we check that):
  the saved partitions of one checkpoint are packed into one flat buffer, one allocation per
  checkpoint instead of one per tensor. ``num_checkpoints`` sizes DeepSpeed's preallocated
  buffers; here it is validated and kept, not needed.
* ``policy`` (zerospeed): a selective policy, see :mod:`zerospeed.checkpointing.selective`;
  ``activation_checkpointing.selective_policy`` in the config sets it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from zerospeed.config import ConfigError, ZeroSpeedConfig, load_config


@dataclasses.dataclass(frozen=True)
class Settings:
    partition_activations: bool = False
    contiguous_checkpointing: bool = False
    num_checkpoints: int | None = None
    cpu_checkpointing: bool = False
    synchronize: bool = False
    profile: bool = False
    policy: Any = None


_SETTINGS: Settings = Settings()
_MPU: Any = None
_CONFIGURED = False
_BY_USER = False  # configure() called by the user (not by an engine from its config)


def _section(deepspeed_config: Any) -> Any:
    if deepspeed_config is None:
        return None
    cfg = deepspeed_config if isinstance(deepspeed_config, ZeroSpeedConfig) else load_config(deepspeed_config)
    return cfg.activation_checkpointing


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"activation_checkpointing.{name}", f"{value!r} is not a boolean; use True or False")
    return value


def configure(mpu_: Any, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None, profile: bool | None = None,
              policy: Any = None) -> None:
    """Set how :func:`zerospeed.checkpointing.checkpoint` stores and recomputes (DeepSpeed's signature)."""
    global _SETTINGS, _MPU, _CONFIGURED, _BY_USER
    if mpu_ is not None and not callable(getattr(mpu_, "get_model_parallel_group", None)):
        raise TypeError(f"checkpointing.configure: mpu_ must provide get_model_parallel_group(), "
                        f"got {type(mpu_).__name__}")
    section = _section(deepspeed_config)
    values = {
        "partition_activations": section.partition_activations if section else False,
        "contiguous_checkpointing": section.contiguous_memory_optimization if section else False,
        "num_checkpoints": section.number_checkpoints if section else None,
        "cpu_checkpointing": section.cpu_checkpointing if section else False,
        "synchronize": section.synchronize_checkpoint_boundary if section else False,
        "profile": section.profile if section else False,
        "policy": section.selective_policy if section else None,
    }
    for name, given in (("partition_activations", partition_activations),
                        ("contiguous_checkpointing", contiguous_checkpointing),
                        ("cpu_checkpointing", checkpoint_in_cpu), ("synchronize", synchronize),
                        ("profile", profile)):
        if given is not None:
            values[name] = _flag(name, given)
    if num_checkpoints is not None:
        if isinstance(num_checkpoints, bool) or not isinstance(num_checkpoints, int) or num_checkpoints < 1:
            raise ConfigError("activation_checkpointing.number_checkpoints",
                              f"{num_checkpoints!r} is not allowed; must be a positive integer")
        values["num_checkpoints"] = num_checkpoints
    if policy is not None:
        values["policy"] = policy
    if values["contiguous_checkpointing"] and not values["partition_activations"]:
        raise ConfigError("activation_checkpointing.contiguous_memory_optimization",
                          "true requires partition_activations: true (DeepSpeed rule)")
    if values["policy"] is not None:
        from zerospeed.checkpointing.selective import resolve_policy

        values["policy"] = resolve_policy(values["policy"])
        if values["partition_activations"] or values["cpu_checkpointing"]:
            raise ConfigError("activation_checkpointing.selective_policy",
                              "a selective policy cannot be combined with partition_activations or "
                              "cpu_checkpointing (they act on the inputs of a full checkpoint)")
    _SETTINGS = Settings(**values)
    _MPU = mpu_
    _CONFIGURED = True
    _BY_USER = True


def configure_from(config: ZeroSpeedConfig) -> None:
    """The engine's call. An explicit ``configure`` by the user wins; otherwise the engine's config
    decides: its ``activation_checkpointing`` section is applied, and without one the settings an
    earlier engine applied are reset (the newest engine's config is what holds)."""
    global _BY_USER
    if _BY_USER:
        return
    if config.given("activation_checkpointing"):
        configure(None, deepspeed_config=config)
        _BY_USER = False
    elif _CONFIGURED:
        reset()


def is_configured() -> bool:
    return _CONFIGURED


def reset() -> None:
    """Back to the unconfigured defaults (DeepSpeed's ``reset`` also frees its buffers: nothing is
    buffered across steps here)."""
    global _SETTINGS, _MPU, _CONFIGURED, _BY_USER
    _SETTINGS = Settings()
    _MPU = None
    _CONFIGURED = False
    _BY_USER = False


def current() -> Settings:
    return _SETTINGS


def current_mpu() -> Any:
    return _MPU


def tp_group_and_size() -> tuple[Any, int, int]:
    """(tensor-parallel group, its size, this rank in it) for partitioning."""
    if _MPU is not None:
        return (_MPU.get_model_parallel_group(), int(_MPU.get_model_parallel_world_size()),
                int(_MPU.get_model_parallel_rank()))
    from zerospeed.comm.mesh import get_mesh

    mesh = get_mesh()
    if mesh is None:
        return None, 1, 0
    return (mesh.get_model_parallel_group(), int(mesh.get_model_parallel_world_size()),
            int(mesh.get_model_parallel_rank()))
