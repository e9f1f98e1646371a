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
  (:class:`~zerospeed.zero.offload.swap.NvmeStateSwapper`); only ``step`` and the swap buffers
  are in memory. A separate fp32 master (16-bit model, or a model on an accelerator) is swapped
  too, as ZeRO-Infinity does: its tensor keeps its shape with its storage freed, is updated in
  the swap buffer and copied into the parameter shard from there, and comes back into memory only
  for a checkpoint (:meth:`OffloadTier.resident_state`). Stage 3's ``GatheredParameters`` edits
  reach it through :meth:`OffloadTier.overwrite_master`. When the model is fp32 on the CPU the
  master *is* the parameter shard (the model itself) and stays.

The step (:meth:`OffloadTier.step`) runs :mod:`zerospeed.ops.adam`'s CPU Adam update (torch's
arithmetic, chunked over worker threads) with the kernel family of the ``fast_paths.adam_kernel``
switch: forced, else the optimizer's own forced ``adam_kernel`` (CPU Adam), else timed once on this
tier's shard sizes at construction (:mod:`zerospeed.ops.adam.kernel_choice`; each rank updates its
own shard, so ranks need not agree). ``fast_paths.direct_io`` goes to the NVMe swap files' I/O
handle, decided for the swap folder at construction.

* states in host memory: one sub-group per bucket through
  :func:`~zerospeed.ops.adam.run_subgroup_pipeline`, so on a GPU the gradient of the next
  sub-group is copied to the host while this one is updated and the previous one's new master is
  copied back (CUDA streams, pinned buffers); on the CPU an fp32 gradient is used in place;
* states on NVMe: per swap group (consecutive buckets up to ``sub_group_size`` elements, see
  :mod:`~zerospeed.zero.offload.swap`), one kernel call per optimizer param group, while the next
  groups are read and the previous ones written back.

Hyper-parameters are read from the user's optimizer param groups at every step, so lr schedulers
keep working; ``AdamW`` (or ``decoupled_weight_decay``) means decoupled decay. Accepted and without
effect here: ``fast_init`` (swap files are always reserved with ``fallocate``, never written with
zeros), ``pipeline_read`` / ``pipeline_write`` (reads and write-backs always overlap the update)
and ``cpuadam_cores_perc`` (the kernel uses ``torch.get_num_threads()`` workers).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from zerospeed.ops.adam import AdamHyperParams, AdamThreadPool, SubGroup, adam_update, run_subgroup_pipeline
from zerospeed.ops.adam.kernel_choice import choose_adam_kernel, resolve_kernel_setting, shape_of, switch_of
from zerospeed.ops.adam.cpu_adam import CPUAdam
from zerospeed.zero.offload.swap import NvmeStateSwapper


def _free(t: torch.Tensor) -> None:
    """Release ``t``'s memory, keeping the tensor object (and every reference to it)."""
    t.untyped_storage().resize_(0)


def _restore(t: torch.Tensor, values: torch.Tensor) -> None:
    """Give a freed ``t`` its memory back and fill it with ``values``."""
    t.untyped_storage().resize_(t.numel() * t.element_size())
    t.copy_(values.reshape(t.shape))


def _usable_in_place(grad: torch.Tensor) -> bool:
    """A gradient the CPU kernel can read (and scale) where it is: fp32 in host memory."""
    return grad.device.type == "cpu" and grad.dtype == torch.float32


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` are the same elements (a flat bucket's ``param_shard()`` is a new
    view at every call, so identity says nothing)."""
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
                 buckets: Sequence[Any], masters: Sequence[torch.Tensor], sub_group_size: int = 1_000_000_000,
                 fast_paths: Any = None) -> None:
        self.optimizer = optimizer
        self.config = config
        self.slots = [_Slot(b, m, i) for i, (b, m) in enumerate(zip(buckets, masters))]
        self.amsgrad = any(g.get("amsgrad", False) for g in optimizer.param_groups)
        self.keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if self.amsgrad else [])
        self.pin = bool(config.pin_memory) and torch.cuda.is_available()
        self.swapper: NvmeStateSwapper | None = None
        self.steps: list[torch.Tensor] = []
        #: NVMe with separate fp32 masters (16-bit model, or a model on an accelerator): the masters
        #: are swapped too, under the key "master"; ``slot.master`` keeps its shape, storage freed
        self.swap_master = config.device == "nvme" and bool(self.slots) and all(
            not same_memory(s.bucket.param_shard(), s.master) for s in self.slots)
        if config.device == "nvme":
            keys = (["master"] if self.swap_master else []) + self.keys
            self.swapper = NvmeStateSwapper(config.nvme_path, keys, [s.master.numel() for s in self.slots],
                                            aio_config, int(config.buffer_count), rank, pin_memory=self.pin,
                                            group_numel=int(sub_group_size),
                                            direct_io=getattr(fast_paths, "direct_io", "auto"))
            self.steps = [torch.zeros((), dtype=torch.float32) for _ in self.slots]
            if self.swap_master:
                for slot in self.slots:
                    self.swapper.write(slot.index, {"master": slot.master})
                    _free(slot.master)
        self._grad_buffers: list[torch.Tensor] = []  # host fp32 staging for gradients that need a copy
        self._pool = AdamThreadPool.shared(max(1, torch.get_num_threads()))
        #: the Adam kernel family of the offloaded update (see the module docstring)
        self.kernel = self._choose_kernel(fast_paths)

    def _choose_kernel(self, fast_paths: Any) -> str:
        setting, source = resolve_kernel_setting(getattr(fast_paths, "adam_kernel", "auto"),
                                                 "fast_paths.adam_kernel"), "fast_paths.adam_kernel"
        own = switch_of(self.optimizer)
        if setting == "auto" and own is not None and own.pooled and own.setting != "auto":
            setting, source = own.setting, own.source  # a CPU Adam built with a forced adam_kernel
        if not self.slots:
            return "fused"
        shape = shape_of([s.master.numel() for s in self.slots], "cpu", torch.float32, torch.float32, pooled=True)
        return choose_adam_kernel(setting, shape, amsgrad=self.amsgrad, source=source, pool=self._pool)

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

    def _staging(self, k: int, numel: int) -> torch.Tensor:
        """Host fp32 buffer ``k`` for gradients that need a copy (a 16-bit or device gradient),
        grown to ``numel`` elements on demand; its first ``numel`` elements."""
        while len(self._grad_buffers) <= k:
            self._grad_buffers.append(torch.empty(0, dtype=torch.float32))
        if self._grad_buffers[k].numel() < numel:
            self._grad_buffers[k] = torch.empty(numel, dtype=torch.float32, pin_memory=self.pin)
        return self._grad_buffers[k].narrow(0, 0, numel)

    # -- the step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, factor: float, residency: Any = None) -> set[int]:
        """Update every offloaded bucket with its reduced gradient times ``factor``.

        Returns the ids of the buckets whose parameter shard was already refreshed from the new
        master (a separate master on another device or dtype is copied back here).
        ``residency`` (stage 3 with ``offload_param``) swaps parameter shards in as they are
        updated: the next group's are read while this one is updated, each released as written.
        """
        published = {id(s.bucket) for s in self.slots if not same_memory(s.bucket.param_shard(), s.master)}
        if self.swapper is not None:
            groups = self.swapper.groups

            def body(g: int, states: dict[int, dict[str, torch.Tensor]]) -> None:
                after = groups[g + 1] if g + 1 < len(groups) else []
                with self._shards_of(residency, groups[g], after):
                    self._update(groups[g], factor, states)

            self.swapper.run(body)  # the swap ring sets the pace: reads ahead, write-backs behind
        elif residency is not None:
            for i in range(len(self.slots)):
                with self._shards_of(residency, [i], [i + 1] if i + 1 < len(self.slots) else []):
                    self._update([i], factor, None)
        else:
            self._pipelined_step(factor)
        return published

    def _shards_of(self, residency: Any, members: list[int], after: list[int]) -> Any:
        if residency is None:
            return nullcontext()
        residency.prefetch([self.slots[i].bucket for i in after])
        return residency.hold([self.slots[i].bucket for i in members], dirty=True)

    def _update(self, members: list[int], factor: float, states: dict[int, dict[str, torch.Tensor]] | None) -> None:
        """Copy in the gradients of ``members``, update them (one kernel call per optimizer param
        group) and copy the new masters out to separate parameter shards; copies are inline."""
        copied = [i for i in members if not _usable_in_place(self.slots[i].bucket.reduced_grad())]
        staging = self._staging(0, sum(self.slots[i].master.numel() for i in copied)) if copied else None
        by_group: dict[int, list[Any]] = {}
        offset = 0
        for i in members:
            slot = self.slots[i]
            grad = slot.bucket.reduced_grad()
            host_grad = grad
            if i in copied:
                assert staging is not None
                host_grad = staging.narrow(0, offset, grad.numel())
                offset += grad.numel()
                host_grad.copy_(grad.reshape(-1))
            if factor != 1.0:
                host_grad.mul_(factor)
            st = states[i] if states is not None else self._cpu_state(slot)
            step = self.steps[slot.index] if self.swapper is not None else st["step"]
            step += 1
            by_group.setdefault(slot.bucket.layout.group_index, []).append(
                (self._master_of(i, states), host_grad, st["exp_avg"], st["exp_avg_sq"], st.get("max_exp_avg_sq"),
                 step))
        for gi, items in by_group.items():
            adam_update(items, hyper_params_of(self.optimizer, self.optimizer.param_groups[gi]), pool=self._pool,
                        kernel=self.kernel)
        for i in members:
            shard = self.slots[i].bucket.param_shard()
            if not same_memory(shard, self.slots[i].master):
                shard.view(-1).copy_(self._master_of(i, states))

    def _master_of(self, i: int, states: dict[int, dict[str, torch.Tensor]] | None) -> torch.Tensor:
        """Sub-group ``i``'s fp32 master: in the swap buffer when masters are swapped, else resident."""
        return states[i]["master"] if self.swap_master and states is not None else self.slots[i].master

    def overwrite_master(self, bucket: Any) -> None:
        """Stage 3's ``master_sink``: a ``GatheredParameters`` edit changed ``bucket``'s shard; the
        swapped master takes the new values (as a resident master would by ``copy_``)."""
        assert self.swapper is not None
        slot = next(s for s in self.slots if s.bucket is bucket)
        self.swapper.write_key(slot.index, "master", bucket.param_shard().detach().to(torch.float32))

    def _pipelined_step(self, factor: float) -> None:
        """States in host memory: one sub-group per bucket through the d2h / update / h2d pipeline."""
        subgroups: list[SubGroup] = []
        biggest = max(s.master.numel() for s in self.slots)
        for pos, slot in enumerate(self.slots):
            grad = slot.bucket.reduced_grad()
            shard = slot.bucket.param_shard()
            in_place = _usable_in_place(grad)
            states = self._cpu_state(slot)
            # two staging buffers alternate: the copy of the next sub-group lands while this one is updated
            host_grad = grad if in_place else self._staging(pos % 2, biggest).narrow(0, 0, grad.numel())
            subgroups.append(SubGroup(param=slot.master, grad=host_grad,
                                      exp_avg=states["exp_avg"], exp_avg_sq=states["exp_avg_sq"],
                                      step=states["step"], max_exp_avg_sq=states.get("max_exp_avg_sq"),
                                      device_grad=None if in_place else grad,
                                      device_param=None if same_memory(shard, slot.master) else shard))
        index = {id(sg): pos for pos, sg in enumerate(subgroups)}
        param_groups = self.optimizer.param_groups

        def update(sg: SubGroup) -> None:
            group = param_groups[self.slots[index[id(sg)]].bucket.layout.group_index]
            if factor != 1.0:
                sg.grad.mul_(factor)
            sg.step += 1
            adam_update([(sg.param, sg.grad, sg.exp_avg, sg.exp_avg_sq, sg.max_exp_avg_sq, sg.step)],
                        hyper_params_of(self.optimizer, group), pool=self._pool, kernel=self.kernel)

        run_subgroup_pipeline(subgroups, update)  # device copies overlap the updates (CUDA streams)

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
            master = state.pop("master", None)
            if master is not None:  # back into the master tensor the checkpoint code sees
                _restore(slot.master, master)
            state["step"] = self.steps[slot.index].clone()
            self.optimizer.state[slot.master] = state
        try:
            yield
        finally:
            for slot in self.slots:
                state = self.optimizer.state.pop(slot.master, None) or {}
                if write_back:
                    values = {k: state.get(k) for k in self.keys}
                    if self.swap_master:
                        values["master"] = slot.master
                    self.swapper.write(slot.index, values)
                    step = state.get("step", 0)
                    self.steps[slot.index].fill_(float(step))
                if self.swap_master:
                    _free(slot.master)

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
