"""The Adam/AdamW update over flat CPU buffers: torch's fused kernel, chunked over a thread pool.

The arithmetic is torch's own vectorised kernel (``torch._fused_adamw_`` / ``torch._fused_adam_``,
the code behind ``torch.optim.AdamW(fused=True)`` on CPU), so results are bit-identical to
torch's fused optimizer and equal to its default for-loop implementation within fp32 rounding
(~1e-7 relative). What this module adds is how the work is spread over cores.

Measured on this project's 2-core box (torch 2.13 CPU, AVX512, 32 Mi fp32 elements, 28 B/element
of traffic; ``bench/offload_ops_bench.py`` and ``bench/results/offload_ops*.md``):

* quiet machine (load ~1): one fused call parallelised by OpenMP, the same work as 2-8 Mi-element
  chunks pulled by two worker threads, and DeepSpeedCPUAdam all ran at 32-34 GB/s median
  (one core alone: ~20 GB/s) - the memory system is the limit, not the scheduling;
* loaded machine (load ~5 from other jobs): the pulled chunks reached 18 GB/s against 13 GB/s for
  the single OpenMP call. OpenMP splits the loop statically and waits at a barrier, so one
  preempted thread stalls the whole call; pulled chunks go to whichever worker is running.
* chunks below ~256 Ki elements lose: each costs a GIL hand-off between workers (~0.1 ms under
  load), so the default is 4 Mi elements (16 MiB per stream) and one task runs inline in the
  caller's thread (with its OpenMP threads).

The kernel releases the GIL, so the Python worker threads do run in parallel.

Chunking rules (:func:`plan_chunks`): a contiguous tensor longer than ``chunk_numel`` is cut into
``chunk_numel``-element views; shorter tensors are batched into one task until it holds
``chunk_numel`` elements (one kernel call per task, so many small tensors cost few calls).
``chunk_numel`` is rounded up to a multiple of :data:`CHUNK_ALIGN` (64) elements because the
kernel's vector loop and its scalar tail round differently (measured: chunk lengths that are not
multiples of the vector width change the last bits of the tail elements). With 64-aligned cuts
every element takes the same path as in one whole-tensor call, so the result is bit-identical to
``torch.optim.AdamW(fused=True)`` whatever the chunk size or thread count. The same holds for
sub-group boundaries chosen by a caller: multiples of 64 elements keep a sub-grouped update
bit-identical to a one-shot one, other boundaries differ in the last bit of a few elements.

Mixed precision: when a parameter's dtype differs from its states' dtype (bf16/fp16 parameters
with ``fp32_optimizer_states``, as DeepSpeedCPUAdam does) or the gradient's dtype differs, each
chunk is upcast to the state dtype, updated, and the parameter chunk is written back rounded.

Bias correction off (DeepSpeed's ``bias_correction=False``): the kernel always bias-corrects
with ``1 - beta**step``; feeding it ``step = +inf`` makes both corrections exactly 1.

Kernel families (``kernel=``, the ``adam_kernel`` fast path, chosen by measurement in
:mod:`zerospeed.ops.adam.kernel_choice`): ``"fused"`` is the kernel above; ``"forloop"`` and
``"foreach"`` are torch's own single-tensor and multi-tensor implementations
(``torch.optim.adam.adam(foreach=False/True)``, the code behind ``torch.optim.AdamW()`` /
``AdamW(foreach=True)``), run on the same chunks, so each family gives what torch's optimizer of that
family gives. For-loop and foreach do the same operations in the same order (bit-identical on
CPU, where foreach ops loop over the tensors); fused evaluates the same formula in one pass with a
different rounding order (measured: up to 1 ulp of the parameter after 3 steps).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch.optim.adam import adam as _torch_adam  # torch's functional Adam (for-loop and foreach families)

__all__ = ["AdamHyperParams", "AdamThreadPool", "adam_update", "plan_chunks", "CHUNK_ALIGN",
           "DEFAULT_CHUNK_NUMEL", "KERNELS"]

#: elements per kernel call (4 Mi fp32 = 16 MiB per stream; see the measurements above).
DEFAULT_CHUNK_NUMEL = 4 << 20
#: chunk boundaries fall on multiples of this many elements (>= any CPU vector width).
CHUNK_ALIGN = 64

_INF_STEP = torch.tensor(float("inf"), dtype=torch.float32)


@dataclass(frozen=True)
class AdamHyperParams:
    """Hyper-parameters of one update (one param group)."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False
    adamw_mode: bool = True
    bias_correction: bool = True
    maximize: bool = False

    @classmethod
    def from_group(cls, group: dict) -> AdamHyperParams:
        beta1, beta2 = group["betas"]
        return cls(
            lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]), amsgrad=bool(group["amsgrad"]),
            adamw_mode=bool(group["adamw_mode"]), bias_correction=bool(group["bias_correction"]),
            maximize=bool(group.get("maximize", False)),
        )


# One unit of kernel work: parallel lists (param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq|None,
# step tensor) of same-length tensors.
Item = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", torch.Tensor]


def plan_chunks(items: Sequence[Item], chunk_numel: int) -> list[list[Item]]:
    """Split big tensors into chunk views and batch small ones; see the module docstring."""
    chunk_numel = max(CHUNK_ALIGN, -(-chunk_numel // CHUNK_ALIGN) * CHUNK_ALIGN)
    tasks: list[list[Item]] = []
    batch: list[Item] = []
    batch_numel = 0
    for item in items:
        n = item[0].numel()
        splittable = all(t is None or t.is_contiguous() for t in item[:5])
        if n > chunk_numel and splittable:
            flats = [None if t is None else t.view(-1) for t in item[:5]]
            for start in range(0, n, chunk_numel):
                length = min(chunk_numel, n - start)
                tasks.append([tuple(None if f is None else f.narrow(0, start, length)
                                    for f in flats) + (item[5],)])  # type: ignore[misc]
            continue
        batch.append(item)
        batch_numel += n
        if batch_numel >= chunk_numel:
            tasks.append(batch)
            batch, batch_numel = [], 0
    if batch:
        tasks.append(batch)
    return tasks


#: the kernel families ``adam_update`` runs (see the module docstring)
KERNELS = ("forloop", "foreach", "fused")


def _run_task(task: list[Item], hp: AdamHyperParams, kernel: str = "fused") -> None:
    """One kernel call over the items of ``task`` (all on one device)."""
    params, grads, avgs, sqs, maxs, steps = [], [], [], [], [], []
    write_back: list[tuple[torch.Tensor, torch.Tensor]] = []
    for p, g, m, v, mx, step in task:
        if p.dtype != m.dtype:
            p32 = p.to(m.dtype)
            write_back.append((p, p32))
            p = p32
        if g.dtype != m.dtype:
            g = g.to(m.dtype)
        params.append(p)
        grads.append(g)
        avgs.append(m)
        sqs.append(v)
        if hp.amsgrad:
            maxs.append(mx)
        steps.append(step if hp.bias_correction else _INF_STEP)
    if kernel == "fused":
        if params[0].device.type != "cpu":  # the kernel wants steps on the params' device
            steps = [s.to(params[0].device) for s in steps]
        fused = torch._fused_adamw_ if hp.adamw_mode else torch._fused_adam_
        fused(params, grads, avgs, sqs, maxs, steps, lr=hp.lr, beta1=hp.beta1, beta2=hp.beta2,
              weight_decay=hp.weight_decay, eps=hp.eps, amsgrad=hp.amsgrad, maximize=hp.maximize)
    elif kernel in ("forloop", "foreach"):
        # torch's implementation increments the step tensors it is given: it gets fresh ones holding
        # step - 1 (the caller's step, shared by the chunks of one tensor, stays as it is)
        _torch_adam(params, grads, avgs, sqs, maxs, [s - 1 for s in steps], foreach=kernel == "foreach", fused=False,
                    decoupled_weight_decay=hp.adamw_mode, amsgrad=hp.amsgrad, beta1=hp.beta1, beta2=hp.beta2, lr=hp.lr,
                    weight_decay=hp.weight_decay, eps=hp.eps, maximize=hp.maximize)
    else:
        raise ValueError(f"unknown Adam kernel {kernel!r} (known: {', '.join(KERNELS)})")
    for p, p32 in write_back:
        p.copy_(p32)


class AdamThreadPool:
    """Worker threads that each run kernel calls with ONE intra-op thread, pulling tasks.

    ``torch.set_num_threads`` is per OS thread under OpenMP (torch's CPU backend), so each worker
    sets 1 for itself at start; torch also remembers the value as the default for threads created
    later, so the creating thread restores its own value right after the workers have started.
    """

    _shared: dict[int, AdamThreadPool] = {}
    _shared_pid = os.getpid()
    _shared_lock = threading.Lock()

    def __init__(self, num_workers: int) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self._executor: ThreadPoolExecutor | None = None
        if num_workers > 1:
            previous = torch.get_num_threads()
            started = threading.Barrier(num_workers + 1)

            def init() -> None:
                torch.set_num_threads(1)

            self._executor = ThreadPoolExecutor(num_workers, thread_name_prefix="zerospeed-adam",
                                                initializer=init)
            waits = [self._executor.submit(started.wait) for _ in range(num_workers)]
            started.wait()
            for w in waits:
                w.result()
            torch.set_num_threads(previous)

    @classmethod
    def shared(cls, num_workers: int) -> AdamThreadPool:
        """A process-wide pool per worker count (threads are idle between steps).

        A forked child does not inherit the parent's threads, so the cache is per process id.
        """
        with cls._shared_lock:
            if cls._shared_pid != os.getpid():
                cls._shared, cls._shared_pid = {}, os.getpid()
            pool = cls._shared.get(num_workers)
            if pool is None:
                pool = cls._shared[num_workers] = cls(num_workers)
            return pool

    def shutdown(self) -> None:
        """Stop the worker threads (a shared pool needs no shutdown: its threads idle)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def run(self, tasks: Sequence[list[Item]], hp: AdamHyperParams, kernel: str = "fused") -> None:
        """Run every task; workers pull the next task index from a shared counter."""
        if not tasks:
            return
        if self._executor is None or len(tasks) == 1:
            for task in tasks:
                _run_task(task, hp, kernel)
            return
        lock = threading.Lock()
        cursor = [0]

        def worker() -> None:
            while True:
                with lock:
                    i = cursor[0]
                    cursor[0] += 1
                if i >= len(tasks):
                    return
                _run_task(tasks[i], hp, kernel)

        futures = [self._executor.submit(worker) for _ in range(min(self.num_workers, len(tasks)))]
        for f in futures:
            f.result()


def adam_update(
    items: Sequence[Item],
    hp: AdamHyperParams,
    *,
    pool: AdamThreadPool | None = None,
    chunk_numel: int = DEFAULT_CHUNK_NUMEL,
    kernel: str = "fused",
) -> None:
    """Apply one Adam/AdamW update in place to every ``(param, grad, exp_avg, exp_avg_sq,
    max_exp_avg_sq, step)`` item; ``step`` is a float32 scalar tensor already incremented.

    States must share a dtype per item; params and grads may differ (see the module docstring).
    CPU items are chunked over ``pool`` (default: the shared pool of ``torch.get_num_threads()``
    workers); items on another device go to that device's fused kernel, one call per
    (device, dtype) (not exercised here: no GPU on the development machine). ``kernel`` is one of
    :data:`KERNELS` (the caller's choice; see :mod:`zerospeed.ops.adam.kernel_choice`).
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown Adam kernel {kernel!r} (known: {', '.join(KERNELS)})")
    cpu_items = [it for it in items if it[0].device.type == "cpu"]
    other = [it for it in items if it[0].device.type != "cpu"]
    if cpu_items:
        pool = pool or AdamThreadPool.shared(max(1, torch.get_num_threads()))
        pool.run(plan_chunks(cpu_items, chunk_numel), hp, kernel)
    by_kind: dict[tuple[torch.device, torch.dtype, torch.dtype], list[Item]] = {}
    for it in other:  # device kernels want one device and dtype per call
        by_kind.setdefault((it[0].device, it[0].dtype, it[2].dtype), []).append(it)
    for dev_items in by_kind.values():
        _run_task(dev_items, hp, kernel)
