"""Model-state memory per rank predicted from the ZeRO formulas (a planning tool; no processes).

With Ψ parameters, N data-parallel ranks and K bytes of optimizer state per parameter, the ZeRO
paper's accounting for mixed precision (16-bit parameters and gradients, fp32 master weights
counted inside K: Adam's K = 4 master + 4 momentum + 4 variance = 12) is:

=======  ===========  ===========  ==========  ===================
stage    parameters   gradients    optimizer   total
=======  ===========  ===========  ==========  ===================
0        2Ψ           2Ψ           KΨ          (4 + K)Ψ
1        2Ψ           2Ψ           KΨ/N        4Ψ + KΨ/N
2        2Ψ           2Ψ/N         KΨ/N        2Ψ + (2 + K)Ψ/N
3        2Ψ/N         2Ψ/N         KΨ/N        (4 + K)Ψ/N
=======  ===========  ===========  ==========  ===================

For fp32 training the parameters are their own master: 4-byte parameters and gradients, and K
counts only the optimizer's moments (Adam: 8). Sharded quantities are padded per bucket to a
multiple of N in practice; :func:`estimate_model_state_bytes` gives the unpadded formula.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

#: Bytes of optimizer state per parameter, not counting an fp32 master copy.
OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "lamb": 8, "sgd": 4, "sgd_no_momentum": 0, "adagrad": 4}
PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class ModelStateBytes:
    params: float
    grads: float
    optimizer_states: float  # including the fp32 master copy under mixed precision (the paper's K)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer_states

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


def estimate_model_state_bytes(num_params: int, dp_world_size: int, stage: int, precision: str = "bf16",
                               optimizer: str = "adam") -> ModelStateBytes:
    """Bytes per rank of parameters, gradients and optimizer states for a ZeRO stage.

    >>> estimate_model_state_bytes(10**9, 8, 2, "bf16").total / 2**30  # 2Ψ + 14Ψ/8, in GiB
    3.49...
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be one of 0, 1, 2, 3, got {stage}")
    if precision not in PRECISION_BYTES:
        raise ValueError(f"precision must be one of {', '.join(PRECISION_BYTES)}, got {precision!r}")
    key = optimizer.lower()
    if key not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZER_STATE_BYTES)}, got {optimizer!r}")
    if num_params < 0 or dp_world_size < 1:
        raise ValueError(f"need num_params >= 0 and dp_world_size >= 1, got {num_params}, {dp_world_size}")
    psi, n = float(num_params), float(dp_world_size)
    width = PRECISION_BYTES[precision]
    k = OPTIMIZER_STATE_BYTES[key] + (4 if precision != "fp32" else 0)
    params = width * psi / (n if stage >= 3 else 1)
    grads = width * psi / (n if stage >= 2 else 1)
    optim = k * psi / (n if stage >= 1 else 1)
    return ModelStateBytes(params, grads, optim)


@dataclass(frozen=True)
class TierBytes:
    """Bytes per rank of model state by where it lives: the training device, host memory, NVMe."""

    device: float
    host: float
    nvme: float

    @property
    def total(self) -> float:
        return self.device + self.host + self.nvme

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


OFFLOAD_DEVICES = ("none", "cpu", "nvme")


def estimate_offloaded_bytes(num_params: int, dp_world_size: int, stage: int, precision: str = "bf16",
                             optimizer: str = "adam", offload_optimizer: str = "none",
                             offload_param: str = "none") -> TierBytes:
    """Where :func:`estimate_model_state_bytes`'s bytes live per rank under zerospeed's offload,
    for a model trained on an accelerator.

    With ``offload_optimizer`` the fp32 master (always a separate copy of the device shard then;
    4 bytes per element of the shard) and the optimizer's moments go to host memory (``cpu``) or to
    NVMe (``nvme``). ``offload_param`` (stage 3) moves the 16/32-bit parameter shards to host
    memory or NVMe (the ``max_in_cpu`` cache is not modelled). Gradients stay on the device. Swap
    buffers are not counted (``buffer_count`` x sub-group, see :mod:`zerospeed.zero.offload`).

    >>> t = estimate_offloaded_bytes(10**9, 8, 3, "bf16", offload_optimizer="nvme")
    >>> (t.device, t.host, t.nvme)  # 2Ψ/N params + 2Ψ/N grads; nothing; 4Ψ/N master + 8Ψ/N moments
    (500000000.0, 0.0, 1500000000.0)
    """
    for name, value in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if value not in OFFLOAD_DEVICES:
            raise ValueError(f"{name} must be one of {', '.join(OFFLOAD_DEVICES)}, got {value!r}")
    if offload_optimizer != "none" and stage < 1:
        raise ValueError("offload_optimizer needs ZeRO stage 1, 2 or 3")
    if offload_param != "none" and stage != 3:
        raise ValueError("offload_param needs ZeRO stage 3")
    base = estimate_model_state_bytes(num_params, dp_world_size, stage, precision, optimizer)
    where = {"device": 0.0, "host": 0.0, "nvme": 0.0}
    tier = {"none": "device", "cpu": "host", "nvme": "nvme"}
    where[tier[offload_param]] += base.params
    where["device"] += base.grads
    if offload_optimizer == "none":
        where["device"] += base.optimizer_states
    else:
        master = 4.0 * num_params / dp_world_size  # stage >= 1: the master is sharded
        moments = OPTIMIZER_STATE_BYTES[optimizer.lower()] * float(num_params) / dp_world_size
        where[tier[offload_optimizer]] += master + moments
    return TierBytes(**where)
