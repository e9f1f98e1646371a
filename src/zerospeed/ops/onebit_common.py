"""What the 1-bit optimizers (OneBitAdam, ZeroOneAdam, OneBitLamb) share: DeepSpeed's padding of a compressed buffer,
the transport-name check and its log line, and the rank-local state a checkpoint keeps per rank.

Padding (DeepSpeed's ``divider``): a buffer of ``numel`` elements is compressed at its length rounded up to a
multiple of ``world * lcm(world, 8)`` (so every server chunk is a whole number of bytes of signs); the padded
length enters the scales (``||b|| / sqrt(padded)``), so it is DeepSpeed's rule, not merely any multiple of 8.

Rank-local state: the error-feedback buffers differ per rank (``worker_error`` is this rank's, ``server_error``
holds this rank's server chunk), and 0/1 Adam's parameters and momenta differ per rank between two
synchronisations. An optimizer lists them in :meth:`rank_local_state` (flat name -> tensor); an engine checkpoint
writes each rank's into that rank's file and gives :meth:`load_rank_local_state` the saved ranks' dicts, in rank
order. At the same world size each rank takes its own back (bit for bit). At another world size the rule is
:func:`reshard_rank_local`:

* a worker-side tensor (``worker_error``, 0/1 Adam's accumulator, local parameters and momenta) becomes the mean
  over the saved ranks, summed in rank order: the compressed mean every step computes is a mean over workers, so
  the error it still owes (and the local model it averages) is the mean of theirs;
* a server error is the concatenation of the saved ranks' chunks (one vector over the padded buffer), cut to the
  buffer's length, zero-padded to the new padded length and re-chunked: chunk ``r`` of the new world is its slice.

DeepSpeed 0.19.x instead drops both error buffers on every load (and 0/1 Adam its interval counters); zerospeed
keeps them, so a resume continues the same run.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

__all__ = ["BACKENDS", "padded_numel", "check_common", "log_backend", "reshard_rank_local", "WORKER", "SERVER"]

logger = logging.getLogger(__name__)

BACKENDS = ("nccl", "mpi", "hccl")
#: how a rank-local tensor reshards at another world size
WORKER, SERVER = "worker", "server"


def padded_numel(numel: int, world: int) -> int:
    """``numel`` rounded up to DeepSpeed's ``world * lcm(world, 8)``."""
    unit = world * (world * 8 // math.gcd(world, 8))
    return -(-numel // unit) * unit


def check_common(name: str, betas: Sequence[float], amsgrad: bool, eps_inside_sqrt: bool, comm_backend_name: str,
                 ints: Mapping[str, Any]) -> None:
    """The argument checks every 1-bit optimizer makes (one line naming the argument)."""
    if amsgrad:
        raise ValueError(f"{name}: amsgrad=True is not supported (nor by DeepSpeed's {name})")
    if eps_inside_sqrt:
        raise ValueError(f"{name}: eps_inside_sqrt=True is not supported (eps is added after the square root)")
    if comm_backend_name not in BACKENDS:
        raise ValueError(f"{name}: comm_backend_name {comm_backend_name!r} is not one of {list(BACKENDS)}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{name}: betas must be two numbers in [0, 1), got {tuple(betas)!r}")
    for key, (value, low) in ints.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}: {key} must be an int >= {low}, got {value!r}")


def log_backend(name: str, comm_backend_name: str, cuda_aware: bool, group: Any) -> None:
    if dist.is_initialized() and dist.get_rank() == 0:
        logger.info("%s: comm_backend_name %r (cuda_aware=%s) maps to the data-parallel group's own backend (%s)",
                    name, comm_backend_name, cuda_aware, dist.get_backend(group))


def _repad(flat: torch.Tensor, length: int, world: int) -> torch.Tensor:
    out = torch.zeros(padded_numel(length, world), dtype=flat.dtype)
    n = min(length, flat.numel())
    out[:n] = flat[:n]
    return out


def reshard_rank_local(saved: Sequence[Mapping[str, torch.Tensor]], kinds: Mapping[str, str],
                       lengths: Mapping[str, int], rank: int, world: int) -> dict[str, torch.Tensor]:
    """This rank's rank-local tensors at ``world`` from the ``saved`` ranks' (see the module docstring).

    ``kinds[name]`` is :data:`WORKER` or :data:`SERVER` (names missing from it are worker-side); ``lengths[name]``
    is, for an error buffer, the unpadded length of the buffer it compensates: a worker error is padded to
    :func:`padded_numel` of it, a server error is its chunk. Other tensors keep their shape.
    """
    if len(saved) == world:
        return {k: v.clone() for k, v in saved[rank].items()}
    out: dict[str, torch.Tensor] = {}
    for name in saved[0]:
        if kinds.get(name, WORKER) == SERVER:
            padded = _repad(torch.cat([s[name].reshape(-1) for s in saved]), lengths[name], world)
            chunk = padded.numel() // world
            out[name] = padded[rank * chunk:(rank + 1) * chunk].clone()
            continue
        total = saved[0][name].clone()
        for s in saved[1:]:
            total.add_(s[name])
        total.div_(len(saved))
        out[name] = _repad(total.reshape(-1), lengths[name], world) if name in lengths else total
    return out


class RankLocalState:
    """Mixin: the checkpoint protocol above over per-parameter optimizer state.

    A subclass sets :attr:`rank_local_keys` (per-parameter state the element-wise checkpoint must not write:
    padded error buffers and other per-rank tensors) and may override :meth:`_extra_rank_local` for per-rank
    tensors the element-wise checkpoint also writes (0/1 Adam's local parameters and momenta); ``_error_length(p)``
    gives the unpadded length a parameter's error buffers compensate.
    """

    rank_local_keys: tuple[str, ...] = ("worker_error", "server_error")
    param_groups: list[dict[str, Any]]
    state: Any

    def _all_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _error_length(self, p: torch.Tensor) -> int:
        return p.numel()

    def _extra_rank_local(self, i: int, p: torch.Tensor) -> dict[str, torch.Tensor]:
        return {}

    def rank_local_state(self) -> dict[str, torch.Tensor]:
        """This rank's per-rank tensors by flat name (``p<index>.<key>``, index over all groups' parameters)."""
        out: dict[str, torch.Tensor] = {}
        for i, p in enumerate(self._all_params()):
            st = self.state.get(p, {})
            for key in self.rank_local_keys:
                if torch.is_tensor(st.get(key)):
                    out[f"p{i}.{key}"] = st[key]
            for key, t in self._extra_rank_local(i, p).items():
                out[f"p{i}.{key}"] = t
        return out

    def load_rank_local_state(self, saved: Sequence[Mapping[str, torch.Tensor]], rank: int, world: int) -> None:
        """Install this rank's share of the saved ranks' tensors (:func:`reshard_rank_local`)."""
        params = self._all_params()
        kinds, lengths = {}, {}
        for name in saved[0] if saved else ():
            i, key = name[1:].split(".", 1)
            if key.endswith("server_error"):
                kinds[name] = SERVER
            if key.endswith("_error"):
                lengths[name] = self._error_length(params[int(i)])
        mine = reshard_rank_local(saved, kinds, lengths, rank, world)
        for name, t in mine.items():
            i, key = name[1:].split(".", 1)
            p = params[int(i)]
            if key == "param":
                with torch.no_grad():
                    p.copy_(t.view_as(p))
                continue
            st = self.state.setdefault(p, {})
            whole = not key.endswith("_error") and t.numel() == p.numel()  # else a flat buffer
            st[key] = t.to(p.device).reshape(p.shape if whole else (-1,))
