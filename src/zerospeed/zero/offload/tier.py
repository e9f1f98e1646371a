"""The offloaded optimizer tier: which buckets it owns, and its Adam step (CPU memory or NVMe).

Unit of offload: a *sub-group* is one bucket's shard on this rank (DeepSpeed's sub-groups are
likewise runs of whole parameters). Stages 1-2 cap their buckets at ``sub_group_size`` elements
when offloading, so a sub-group never exceeds it unless one parameter does; stage 3's buckets are
per module. ``ratio`` (DeepSpeed: stage 3 only; here any stage) offloads the first buckets, in
bucket order, until that fraction of the shard elements is offloaded (at least one bucket); the
others stay with the device optimizer (the user's torch optimizer, on the model's device).

Per offloaded bucket, on this rank:

* the fp32 master lives in host memory: the parameter shard itself when the model is fp32 on the
  CPU (no copy), a separate host tensor otherwise (pinned with ``pin_memory`` on a GPU machine);
* ``device: cpu`` - ``optimizer.state[master]`` holds ``step``, ``exp_avg``, ``exp_avg_sq``
  (``max_exp_avg_sq`` with amsgrad) as flat fp32 host tensors, torch's layout, so checkpoints
  and inspection see an ordinary Adam state;
* ``device: nvme`` - the element-wise states live in swap files
  (:class:`~zerospeed.zero.offload.swap.NvmeStateSwapper`); only ``step`` and the
  ``buffer_count`` swap buffers are in memory. The master stays in host memory (under fp32 on the
  CPU it *is* the model; swapping a 16-bit run's master is left to a later version).

The step (:meth:`OffloadTier.step`) runs :mod:`zerospeed.ops.adam`'s fused CPU Adam kernel over
the sub-groups through :func:`~zerospeed.ops.adam.run_subgroup_pipeline`: on a GPU the gradient
of the next sub-group is copied to the host while this one is updated and the previous one's
updated master is copied back (CUDA streams, pinned buffers); on the CPU the gradient is used in
place when it is already fp32. With NVMe the reads of the next sub-groups and the write-back of
the previous ones overlap the update too. Hyper-parameters are read from the user's optimizer
param groups at every step, so lr schedulers keep working; the update is torch's Adam/AdamW
arithmetic (``AdamW`` or ``decoupled_weight_decay`` -> decoupled decay).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from zerospeed.ops.adam import AdamHyperParams, AdamThreadPool, SubGroup, adam_update, run_subgroup_pipeline
from zerospeed.ops.adam.cpu_adam import CPUAdam
from zerospeed.zero.offload.swap import NvmeStateSwapper


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.dtype == b.dtype and a.data_ptr() == b.data_ptr() and a.numel() == b.numel()


def choose_offloaded(numels: Sequence[int], ratio: float) -> list[int]:
    """Indices of the buckets to offload: the first ones until ``ratio`` of all elements is reached.

    Always at least one bucket when there is any; ``ratio >= 1`` offloads all of them.
    """
    if not numels:
        return []
    if ratio >= 1.0:
        return list(range(len(numels)))
    target = ratio * sum(numels)
    out: list[int] = []
    done = 0
    for i, n in enumerate(numels):
        if out and done + n / 2 > target:  # stop at the boundary closest to the target
            break
        out.append(i)
        done += n
    return out


def hyper_params_of(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> AdamHyperParams:
    """torch Adam/AdamW (or CPUAdam) param-group settings as the kernel's hyper-parameters."""
    beta1, beta2 = group["betas"]
    if isinstance(optimizer, CPUAdam):
        adamw, bias_correction = bool(group["adamw_mode"]), bool(group["bias_correction"])
    else:
        adamw = isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))
        bias_correction = True
    lr = group["lr"]
    return AdamHyperParams(lr=float(lr), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                           weight_decay=float(group["weight_decay"]), amsgrad=bool(group.get("amsgrad", False)),
                           adamw_mode=adamw, bias_correction=bias_correction,
                           maximize=bool(group.get("maximize", False)))


@dataclass
class _Slot:
    bucket: Any  # FlatBucket or Stage3Bucket: param_shard(), reduced_grad(), layout
    master: torch.Tensor  # fp32, host
    index: int  # position among the offloaded buckets (the swap file's sub-group number)


class OffloadTier:
    """Optimizer state and update of the offloaded buckets of one :class:`ShardedOptimizerState`."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: Any, aio_config: Any, rank: int,
                 buckets: Sequence[Any], masters: Sequence[torch.Tensor]) -> None:
        self.optimizer = optimizer
        self.config = config
        self.slots = [_Slot(b, m, i) for i, (b, m) in enumerate(zip(buckets, masters))]
        self.amsgrad = any(g.get("amsgrad", False) for g in optimizer.param_groups)
        self.keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if self.amsgrad else [])
        self.pin = bool(config.pin_memory) and torch.cuda.is_available()
        self.swapper: NvmeStateSwapper | None = None
        self.steps: list[torch.Tensor] = []
        if config.device == "nvme":
            self.swapper = NvmeStateSwapper(config.nvme_path, self.keys, [s.master.numel() for s in self.slots],
                                            aio_config, int(config.buffer_count), rank, pin_memory=self.pin)
            self.steps = [torch.zeros((), dtype=torch.float32) for _ in self.slots]
        self._grad_buffers: list[torch.Tensor] = []  # two host fp32 buffers, when gradients need a copy
        self._pool = AdamThreadPool.shared(max(1, torch.get_num_threads()))

    # -- state ------------------------------------------------------------------------------------
    def _cpu_state(self, slot: _Slot) -> dict[str, Any]:
        """``optimizer.state[master]`` as flat fp32 host tensors (created, or normalised after a load)."""
        state = self.optimizer.state[slot.master]
        for key in self.keys:
            t = state.get(key)
            if t is None:
                state[key] = torch.zeros(slot.master.numel(), dtype=torch.float32, pin_memory=self.pin)
            elif t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
                state[key] = t.detach().to("cpu", torch.float32).contiguous()
        step = state.get("step")
        if not torch.is_tensor(step) or step.dtype != torch.float32 or step.device.type != "cpu":
            state["step"] = torch.tensor(float(step if step is not None else 0), dtype=torch.float32)
        return state

    def _step_of(self, slot: _Slot) -> torch.Tensor:
        return self.steps[slot.index] if self.swapper is not None else self._cpu_state(slot)["step"]

    def _host_grad(self, pos: int, numel: int) -> torch.Tensor:
        while len(self._grad_buffers) < 2:
            self._grad_buffers.append(torch.empty(0, dtype=torch.float32))
        buf = self._grad_buffers[pos % 2]
        if buf.numel() < numel:
            buf = torch.empty(max(numel, max(s.master.numel() for s in self.slots)), dtype=torch.float32,
                              pin_memory=self.pin)
            self._grad_buffers[pos % 2] = buf
        return buf.narrow(0, 0, numel)

    # -- the step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, factor: float, residency: Any = None) -> set[int]:
        """Update every offloaded bucket with its reduced gradient times ``factor``.

        Returns the ids of the buckets whose parameter shard was already refreshed from the new
        master (a separate master on another device or dtype is copied back by the pipeline).
        ``residency`` (stage 3 with ``offload_param``) swaps parameter shards in one sub-group at a
        time: the next one is read while this one is updated, and each is released as written.
        """
        subgroups: list[SubGroup] = []
        published: set[int] = set()
        for pos, slot in enumerate(self.slots):
            grad = slot.bucket.reduced_grad()
            shard = slot.bucket.param_shard()
            in_place = grad.device.type == "cpu" and grad.dtype == torch.float32
            host_grad = grad if in_place else self._host_grad(pos, grad.numel())
            states = self._cpu_state(slot) if self.swapper is None else None
            # NVMe: placeholder state views (the swap buffers are bound in update())
            exp_avg = states["exp_avg"] if states else host_grad
            exp_avg_sq = states["exp_avg_sq"] if states else host_grad
            separate = not same_memory(shard, slot.master)
            if separate:
                published.add(id(slot.bucket))
            subgroups.append(SubGroup(param=slot.master, grad=host_grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq,
                                      step=self._step_of(slot),
                                      max_exp_avg_sq=states.get("max_exp_avg_sq") if states else None,
                                      device_grad=None if in_place else grad,
                                      device_param=shard if separate else None))
        index = {id(sg): pos for pos, sg in enumerate(subgroups)}
        groups = self.optimizer.param_groups

        def kernel(sg: SubGroup, pos: int, states: dict[str, torch.Tensor] | None) -> None:
            slot = self.slots[pos]
            hp = hyper_params_of(self.optimizer, groups[slot.bucket.layout.group_index])
            if factor != 1.0:
                sg.grad.mul_(factor)
            sg.step += 1
            if states is None:
                states = {"exp_avg": sg.exp_avg, "exp_avg_sq": sg.exp_avg_sq, "max_exp_avg_sq": sg.max_exp_avg_sq}
            adam_update([(sg.param, sg.grad, states["exp_avg"], states["exp_avg_sq"], states.get("max_exp_avg_sq"),
                          sg.step)], hp, pool=self._pool)

        def one(i: int, states: dict[str, torch.Tensor] | None) -> None:
            """Sub-group ``i`` with inline copies (NVMe, or shards that come and go)."""
            sg = subgroups[i]
            if sg.device_grad is not None:
                sg.grad.copy_(sg.device_grad.reshape(-1))
            kernel(sg, i, states)
            if sg.device_param is not None:
                sg.device_param.view(-1).copy_(sg.param)

        if residency is not None:
            def body(i: int, states: dict[str, torch.Tensor] | None) -> None:
                bucket = self.slots[i].bucket
                if i + 1 < len(self.slots):
                    residency.prefetch([self.slots[i + 1].bucket])
                residency.acquire(bucket)
                try:
                    one(i, states)
                finally:
                    residency.release(bucket, dirty=True)
        else:
            body = one
        if self.swapper is not None:
            # the swap ring sets the pace: reads ahead, write-backs behind the update
            self.swapper.run(range(len(subgroups)), body)
        elif residency is not None:
            for i in range(len(subgroups)):
                body(i, None)
        else:  # device copies overlap the updates (CUDA streams on a GPU)
            run_subgroup_pipeline(subgroups, lambda sg: kernel(sg, index[id(sg)], None))
        return published

    # -- checkpoints ------------------------------------------------------------------------------
    @contextmanager
    def resident_state(self, write_back: bool) -> Iterator[None]:
        """NVMe: put every offloaded state in ``optimizer.state[master]`` for the checkpoint code;
        on exit, with ``write_back``, store what is there then (a load may have replaced it) and
        drop it from memory again. CPU: the state is always there; nothing to do."""
        if self.swapper is None:
            yield
            if write_back:
                for slot in self.slots:
                    if self.optimizer.state.get(slot.master):
                        self._cpu_state(slot)
            return
        for slot in self.slots:
            state = self.swapper.read(slot.index)
            state["step"] = self.steps[slot.index].clone()
            self.optimizer.state[slot.master] = state
        try:
            yield
        finally:
            for slot in self.slots:
                state = self.optimizer.state.pop(slot.master, None) or {}
                if write_back:
                    self.swapper.write(slot.index, {k: state.get(k) for k in self.keys})
                    step = state.get("step", 0)
                    self.steps[slot.index].fill_(float(step))

    # -- accounting and lifecycle -----------------------------------------------------------------
    def memory_bytes(self) -> dict[str, int]:
        """``offload_buffers``: swap and gradient staging buffers; ``optimizer_states_nvme``: on disk."""
        staging = sum(b.numel() * b.element_size() for b in self._grad_buffers)
        if self.swapper is None:
            return {"offload_buffers": staging, "optimizer_states_nvme": 0}
        return {"offload_buffers": staging + self.swapper.buffer_bytes,
                "optimizer_states_nvme": self.swapper.disk_bytes}

    @property
    def swap_folder(self) -> str | None:
        return None if self.swapper is None else self.swapper.folder

    def close(self) -> None:
        if self.swapper is not None:
            self.swapper.close()
