"""Predicted memory of a candidate, per rank, for pruning before anything runs.

Model state comes from zerospeed's ZeRO estimator (:func:`zerospeed.zero.memory.estimate_offloaded_bytes`:
device, host and NVMe bytes for the stage, precision and offload choice); activations are the
model-info run's measured saved-tensor bytes per sample times the micro-batch size (times the
tensor-parallel degree's share, 1/tp). On a CPU run, device and host are the same memory, so the
budget (``autotuning.memory_budget``) is compared with device + host bytes; on a GPU run with
device bytes alone (the host budget is then not modelled). NVMe bytes never count against it.

The process' fixed overhead (the Python interpreter, torch, buffers) is the model-info run's
measured peak minus its predicted bytes, added to every candidate, so the prediction is
anchored to what a run of this script really uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerospeed.autotuning.space import MBS, OFFLOAD_OPT, OFFLOAD_PARAM, STAGE
from zerospeed.zero.memory import estimate_offloaded_bytes


@dataclass(frozen=True)
class ModelInfo:
    """What the model-info run measured (or the user gave in ``autotuning.model_info``)."""

    num_params: int
    activation_mem_per_sample: float
    flops_per_sample: float = 0.0
    overhead_bytes: float = 0.0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelInfo:
        return cls(num_params=int(data["num_params"]),
                   activation_mem_per_sample=float(data.get("activation_mem_per_sample", 0.0)),
                   flops_per_sample=float(data.get("flops_per_sample", 0.0)),
                   overhead_bytes=float(data.get("overhead_bytes", 0.0)))


def precision_of(raw: dict[str, Any]) -> str:
    for key in ("bf16", "bfloat16"):
        if isinstance(raw.get(key), dict) and raw[key].get("enabled"):
            return "bf16"
    if isinstance(raw.get("fp16"), dict) and raw["fp16"].get("enabled"):
        return "fp16"
    return "fp32"


def optimizer_of(raw: dict[str, Any]) -> str:
    name = str((raw.get("optimizer") or {}).get("type", "adam")).lower()
    if name in ("sgd",):
        return "sgd"
    if name in ("adagrad",):
        return "adagrad"
    if name in ("lamb",):
        return "lamb"
    return "adam"


def predict_bytes(info: ModelInfo, candidate: dict[str, Any], config: dict[str, Any], dp_world_size: int,
                  on_gpu: bool = False) -> dict[str, float]:
    """Per-rank bytes of a candidate: ``device``, ``host``, ``nvme`` and ``budgeted`` (what counts
    against the memory budget)."""
    stage = int(candidate[STAGE])
    tp = int(candidate.get("tensor_parallel.autotp_size", 1) or 1)
    tiers = estimate_offloaded_bytes(
        info.num_params // tp, dp_world_size, stage, precision_of(config), optimizer_of(config),
        offload_optimizer=str(candidate.get(OFFLOAD_OPT, "none")) if stage >= 1 else "none",
        offload_param=str(candidate.get(OFFLOAD_PARAM, "none")) if stage == 3 else "none")
    activations = info.activation_mem_per_sample * int(candidate[MBS]) / tp
    device = tiers.device + activations + (0.0 if on_gpu else info.overhead_bytes)
    budgeted = device if on_gpu else device + tiers.host
    return {"device": device, "host": tiers.host, "nvme": tiers.nvme, "budgeted": budgeted}


def max_mbs_within(info: ModelInfo, candidate: dict[str, Any], config: dict[str, Any], dp_world_size: int,
                   budget: float, upper: int, on_gpu: bool = False) -> int:
    """The largest micro-batch size whose predicted bytes fit ``budget`` (0 if even 1 does not)."""
    if budget <= 0:
        return upper
    fixed = predict_bytes(info, {**candidate, MBS: 0}, config, dp_world_size, on_gpu)["budgeted"]
    per_sample = info.activation_mem_per_sample / int(candidate.get("tensor_parallel.autotp_size", 1) or 1)
    if fixed > budget:
        return 0
    if per_sample <= 0:
        return upper
    return int(min(upper, (budget - fixed) // per_sample))
