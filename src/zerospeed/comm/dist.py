"""Process-group set-up: :func:`init_distributed` and rank / world-size queries.

Decisions:

* torchrun (or the ``zerospeed`` launcher, which is torchrun) provides ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; we read them through torch's ``env://``
  init. Started with plain ``python`` (no ``RANK`` in the environment) we create a world of one
  on a free loopback port, so single-process scripts need no launcher.
* The backend is NCCL when CUDA is available, gloo otherwise; ``dist_backend`` overrides.
* The call is idempotent: an initialised default group is left as it is.
* ``timeout`` (default 30 min, as DeepSpeed) may also come from ``ZEROSPEED_DIST_TIMEOUT_S``; it bounds
  every collective (:mod:`zerospeed.comm.health` names the rank that stopped participating).
* Under torchrun's agent store the group's keys are prefixed with the restart attempt, so an elastic
  restart never reads the previous attempt's addresses; the group zerospeed creates is torn down
  in order at exit (:mod:`zerospeed.comm.lifecycle`).
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from zerospeed.comm import lifecycle

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _timeout_from_env(timeout: datetime.timedelta) -> datetime.timedelta:
    """``ZEROSPEED_DIST_TIMEOUT_S`` replaces the default timeout (an explicit ``timeout=`` wins)."""
    text = os.environ.get("ZEROSPEED_DIST_TIMEOUT_S")
    if not text or timeout != DEFAULT_TIMEOUT:
        return timeout
    try:
        seconds = float(text)
    except ValueError:
        raise ValueError(f"ZEROSPEED_DIST_TIMEOUT_S={text!r} is not a number of seconds") from None
    if seconds <= 0:
        raise ValueError(f"ZEROSPEED_DIST_TIMEOUT_S={text!r} must be positive")
    return datetime.timedelta(seconds=seconds)


def _elastic_attempt_store(timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun's agent store, a store whose keys are private to this restart attempt.

    torchrun's elastic agent hosts the store and keeps it across restarts of the worker group, so
    the keys a process group publishes (gloo's listening addresses) survive a restart; a restarted
    rank can read a dead peer's address from the previous attempt and fail with "connection
    refused". Prefixing every key with the attempt number (``TORCHELASTIC_RESTART_COUNT``) keeps
    each attempt's rendezvous apart.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    try:
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    base = dist.TCPStore(addr, port, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"zerospeed/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", base)


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = False,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Initialise torch.distributed's default process group (DeepSpeed-compatible signature).

    ``auto_mpi_discovery``, ``distributed_port``, ``dist_init_required`` and ``config`` are
    accepted for DeepSpeed compatibility; rendezvous comes from torchrun's environment.
    """
    del auto_mpi_discovery, dist_init_required, config
    if dist.is_initialized():
        return
    backend = dist_backend or default_backend()
    timeout = _timeout_from_env(timeout)
    if backend not in ("gloo", "nccl", "mpi", "ucc", "xccl"):
        raise ValueError(f"init_distributed: dist_backend={backend!r} is not one of gloo, nccl, mpi, ucc, xccl")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("init_distributed: dist_backend='nccl' needs CUDA, and torch.cuda.is_available() is False")
    env_rank = os.environ.get("RANK")
    if rank < 0 and env_rank is None and init_method is None:
        # Plain `python script.py`: a world of one.
        rank, world_size = 0, 1
        init_method = f"tcp://127.0.0.1:{_free_port() if distributed_port == 29500 else distributed_port}"
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout}
    if init_method is not None:
        kwargs["init_method"] = init_method
    if rank >= 0:
        kwargs["rank"] = rank
        kwargs["world_size"] = world_size
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if init_method is None and rank < 0:
        store = _elastic_attempt_store(timeout)
        if store is not None:
            kwargs.update(store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    dist.init_process_group(**kwargs)
    lifecycle.register_created_group()  # orderly teardown at exit (zerospeed.shutdown)
    if verbose and dist.get_rank() == 0:
        print(f"zerospeed: initialised {backend} with world size {dist.get_world_size()}", flush=True)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def device_for_backend() -> torch.device:
    """The device this rank computes on: its CUDA device under NCCL, else the CPU.

    ``DS_ACCELERATOR=cuda`` (DeepSpeed's switch) asks for CUDA explicitly: then a rank computes on CUDA
    device ``LOCAL_RANK % device_count`` under any backend, e.g. CUDA tensors over gloo (gloo carries them
    for all-reduce and broadcast, all zerospeed's gloo path needs), which lets several ranks share one GPU.
    Without it, gloo means the CPU, so CPU runs stay on the CPU on a machine that has a GPU."""
    if is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if os.environ.get("DS_ACCELERATOR", "").strip().lower() == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", get_local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


# -- DeepSpeed's group helpers (``deepspeed.comm``) -----------------------------------------------------
def is_available() -> bool:
    return dist.is_available()


def get_backend(group: dist.ProcessGroup | None = None) -> str | None:
    return dist.get_backend(group) if is_initialized() else None


def new_group(ranks: list[int] | None = None, **kwargs: Any) -> dist.ProcessGroup | None:
    """A process group over global ``ranks`` (every rank must call it, as in torch)."""
    if not is_initialized():
        raise RuntimeError("new_group: call zerospeed.init_distributed() (or initialize) first")
    world = dist.get_world_size()
    bad = [r for r in (ranks or []) if not 0 <= r < world]
    if bad:
        raise ValueError(f"new_group: ranks {bad} are outside the world of {world}")
    return dist.new_group(ranks=ranks, **kwargs)


def get_global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    if group is None or not is_initialized():
        return group_rank
    return dist.get_global_rank(group, group_rank)


def get_all_ranks_from_group(group: dist.ProcessGroup | None = None) -> list[int]:
    if group is None or not is_initialized():
        return list(range(get_world_size()))
    return dist.get_process_group_ranks(group)


def destroy_process_group(group: dist.ProcessGroup | None = None) -> None:
    if is_initialized():
        dist.destroy_process_group(group)
