"""Master-weight dtype and autocast settings, from the parsed config (issue 20, point 7).

``bf16.bf16_master_weights_and_grads`` + ``bf16.bf16_optimizer_states`` (DeepSpeed's names): the
ZeRO optimizer keeps no fp32 copy. The bf16 parameter shard *is* the master, the gradients it is
updated with stay bf16, and Adam's moments are created in bf16 beside it. Per trainable element
and rank that saves the fp32 master (4 bytes) and half of the two moments (4 of 8 bytes): model
state goes from 2 + 2 + 12 to 2 + 2 + 4 bytes per element (with ZeRO's 1/N applied as usual).
The price is bf16 update precision (8 significant bits): steps smaller than 2**-8 of a weight are
lost; the test states the loss tolerance against fp32 masters.

Rules (DeepSpeed's, checked here so the error names the key): both need ``bf16.enabled`` and ZeRO
stage 1, 2 or 3; states need masters (the config parser already says so). Decision: masters
without ``bf16_optimizer_states`` would need fp32 moments beside bf16 masters, which DeepSpeed
only builds with ZeRO-Offload's CPU Adam; zerospeed does not build that variant and says so.
``fp16.fp16_master_weights_and_grads`` is refused the same way (fp16 Adam moments underflow).

``torch_autocast`` (DeepSpeed's autocast-based mixed precision): ``engine(...)`` runs the module
under ``torch.autocast(device, dtype)``; alone, parameters, gradients and optimizer stay fp32. With
``bf16.enabled`` too (as DeepSpeed's bf16_master_weight example configures it) the parameters are
bf16 and autocast still runs its fp32-listed ops (softmax, norms, losses) in fp32.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from zerospeed.config import ConfigError, ZeroSpeedConfig

#: the config's precision names (``ZeroSpeedConfig.precision``, ``communication_data_type``) -> torch dtypes; the
#: engine and its DeepSpeed API both read it, so it lives here, below both
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "torch.bfloat16": torch.bfloat16,
                    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
                    "torch.float16": torch.float16}


def master_dtype(config: ZeroSpeedConfig) -> torch.dtype:
    """The dtype of the optimizer's master weights for this config."""
    bf16, stage = config.bf16, config.zero_optimization.stage
    if config.fp16.fp16_master_weights_and_grads:
        raise ConfigError("fp16.fp16_master_weights_and_grads", "true is not supported by zerospeed (fp16 Adam "
                          "moments underflow; DeepSpeed needs ZeRO-Offload's CPU Adam for it); use "
                          "bf16.bf16_master_weights_and_grads with bf16")
    if not bf16.bf16_master_weights_and_grads:
        return torch.float32
    if not bf16.enabled:
        raise ConfigError("bf16.bf16_master_weights_and_grads", "true needs bf16.enabled: true")
    if stage == 0:
        raise ConfigError("bf16.bf16_master_weights_and_grads", "true needs ZeRO stage 1, 2 or 3 (DeepSpeed rule); "
                          "zero_optimization.stage is 0")
    if not bf16.bf16_optimizer_states:
        raise ConfigError("bf16.bf16_master_weights_and_grads", "true without bf16.bf16_optimizer_states: true "
                          "(fp32 moments beside bf16 masters) is not built in zerospeed; set both")
    return torch.bfloat16


def grad_accum_dtype(config: ZeroSpeedConfig) -> torch.dtype | None:
    """The dtype gradients are summed in over micro-batches, when it is not the parameters' (None otherwise).

    ``data_types.grad_accum_dtype: "fp32"`` with bf16 at ZeRO stage 1, 2 or 3, as DeepSpeed 0.19.8 builds it (its
    engine's ``_do_optimizer_sanity_check``): each backward's bf16 gradient is added into an fp32 buffer (stage 1)
    or the reduced shards are summed in fp32 (stages 2, 3). DeepSpeed refuses the mix without ZeRO ("unsupported
    mix"), and so does zerospeed; any other dtype than the training precision is refused by
    :func:`check_unbuilt_values`."""
    value = config.data_types.grad_accum_dtype
    if value is None or value == config.precision:
        return None
    if config.precision == "bf16" and value == "fp32":
        if config.zero_optimization.stage == 0:
            raise ConfigError("data_types.grad_accum_dtype", "'fp32' with bf16 needs ZeRO stage 1, 2 or 3 "
                              "(DeepSpeed refuses this mix at stage 0 too); zero_optimization.stage is 0")
        return torch.float32
    return None  # refused by check_unbuilt_values


def autocast_settings(config: ZeroSpeedConfig) -> tuple[bool, torch.dtype | None]:
    """(enabled, dtype) of ``torch_autocast``; dtype None means torch's default for the device."""
    section: Any = getattr(config, "torch_autocast", None)
    if section is None or not section.enabled:
        return False, None
    if config.precision == "fp16":  # bf16 + autocast is allowed (DeepSpeed's bf16_master_weight example)
        raise ConfigError("torch_autocast.enabled", "true conflicts with fp16.enabled: true; use one "
                          "mixed-precision method")
    dtype = _AUTOCAST_DTYPES[section.dtype] if section.dtype is not None else None
    if dtype == torch.float16:
        raise ConfigError("torch_autocast.dtype", "fp16 needs loss scaling, which zerospeed's torch_autocast does not "
                          "apply; use bfloat16, or the fp16 section")
    return True, dtype


def autocast_context(enabled: bool, dtype: torch.dtype | None, device_type: str) -> Any:
    """``torch.autocast`` for the engine's forward, or a no-op context."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype or torch.get_autocast_dtype(device_type))


def check_unbuilt_values(config: ZeroSpeedConfig) -> None:
    """Values of parsed keys that would change the math in a way zerospeed does not build: refused
    by name instead of being ignored (see tests/test_compat_config_fields.py for the keys that are
    deliberately accepted and ignored)."""
    if config.gradient_allreduce_op != "mean":
        raise ConfigError("gradient_allreduce_op", f"{config.gradient_allreduce_op!r} is not supported by zerospeed; "
                          "gradients are averaged over data-parallel ranks ('mean')")
    dt = config.data_types
    for name in ("grad_accum_dtype", "param_dtype", "buffer_dtype"):
        value = getattr(dt, name)
        if name == "grad_accum_dtype" and grad_accum_dtype(config) is not None:
            continue  # bf16 with fp32 accumulation at ZeRO 1-3: built
        if value is not None and value != config.precision:
            raise ConfigError(f"data_types.{name}", f"{value!r} differs from the training precision "
                              f"{config.precision!r}; zerospeed accumulates gradients in the bucket dtype and keeps "
                              "parameters and buffers in the training precision")
