"""``CPUAdam``: Adam/AdamW for optimizer states in host memory (ZeRO-Offload's optimizer).

Semantics are torch's: ``adamw_mode=True`` is ``torch.optim.AdamW`` (decoupled weight decay),
``False`` is ``torch.optim.Adam`` (L2 added to the gradient); with fp32 tensors the result is
bit-identical to ``torch.optim.AdamW(fused=True)`` / ``Adam(fused=True)`` and within fp32 rounding
(~1e-7 relative) of their default implementation. ``bias_correction=False`` (DeepSpeed's switch)
drops both bias corrections. The arithmetic is torch's fused CPU kernel; the speed comes from
running it in chunks on a pool of worker threads (:mod:`zerospeed.ops.adam.kernel`, with the
measurements that chose this).

Three ways to drive it:

* ``step()`` - like any torch optimizer, over the CPU parameters of its param groups.
* ``step_subgroup(subgroup_id)`` - DeepSpeed's ZeRO-3 call: the param groups currently hold one
  sub-group's flat fp32 partition; its state is kept under the key ``subgroup_id``.
* ``step_subgroups(subgroups)`` - the offload pipeline: explicit :class:`SubGroup` host buffers
  (param, grad, exp_avg, exp_avg_sq, step), with optional device gradient source and device
  parameter destination; on CUDA the d2h copy of the next sub-group, the CPU update of this one
  and the h2d copy of the previous one overlap (see :mod:`~zerospeed.ops.adam.subgroup_pipeline`;
  **the CUDA path is unmeasured: the project's machine has no GPU**). On CPU-only machines the
  same code runs with inline copies.

``adam_kernel`` (``auto``, ``forloop``, ``foreach``, ``fused``) picks the arithmetic: torch's fused
kernel, or torch's for-loop / multi-tensor implementation on the same chunks; ``auto`` (the default)
times them on the first step's shapes (:mod:`zerospeed.ops.adam.kernel_choice`) and keeps the
choice for the optimizer's life. The bit-identity with ``AdamW(fused=True)`` above holds for
``fused``; the other two equal ``AdamW()`` / ``AdamW(foreach=True)``.

``sub_group_size`` bounds how many elements one pipeline stage updates when ``step()`` cuts its
parameters into sub-groups; on CPU it only sets the granularity (results do not depend on it).

Arguments after ``lr`` are keyword-only: torch's Adam and DeepSpeedCPUAdam order their positional
arguments differently (``betas`` vs ``bias_correction`` third), so a positional call would be
silently misread by one of the two audiences.

State per parameter, as torch's: ``step`` (float32 scalar tensor), ``exp_avg``, ``exp_avg_sq``
(and ``max_exp_avg_sq`` with amsgrad), so ``state_dict()`` round-trips with torch's Adam/AdamW.
States are fp32 for low-precision parameters unless ``fp32_optimizer_states=False`` (then they
take the parameter's dtype), as in DeepSpeedCPUAdam.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from zerospeed.ops.adam.kernel import (
    DEFAULT_CHUNK_NUMEL,
    AdamHyperParams,
    AdamThreadPool,
    Item,
    adam_update,
)
from zerospeed.ops.adam.kernel_choice import attach_switch, choose_adam_kernel, resolve_kernel_setting, shape_of
from zerospeed.ops.adam.subgroup_pipeline import (
    CudaStreamCopies,
    SubGroup,
    SyncCopies,
    run_subgroup_pipeline,
)

__all__ = ["CPUAdam", "DeepSpeedCPUAdam"]

#: DeepSpeed's default ``zero_optimization.sub_group_size``.
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW on CPU tensors, vectorised and multithreaded; see the module docstring."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        *,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        bias_correction: bool = True,
        maximize: bool = False,
        fp32_optimizer_states: bool = True,
        sub_group_size: int = DEFAULT_SUB_GROUP_SIZE,
        num_threads: int | None = None,
        chunk_numel: int = DEFAULT_CHUNK_NUMEL,
        adam_kernel: str = "auto",
    ) -> None:
        setting = resolve_kernel_setting(adam_kernel, "CPUAdam(adam_kernel=...)")
        if not lr >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not eps >= 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
        if not weight_decay >= 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        for name, value in (("sub_group_size", sub_group_size), ("chunk_numel", chunk_numel)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, adamw_mode=adamw_mode, bias_correction=bias_correction,
                        maximize=maximize)
        super().__init__(params, defaults)
        self.fp32_optimizer_states = fp32_optimizer_states
        self.sub_group_size = sub_group_size
        self.chunk_numel = chunk_numel
        self.num_threads = num_threads
        #: the adam_kernel choice (settled at the first step unless forced, or by the engine)
        self.kernel_switch = attach_switch(self, setting, "CPUAdam(adam_kernel=...)", pooled=True,
                                           chunk_numel=chunk_numel)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # load_state_dict() installs the saved groups; one saved by torch's Adam/AdamW or by
        # DeepSpeedCPUAdam lacks some of our keys (adamw_mode, bias_correction...): take defaults.
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``load_state_dict``, keeping fp32 states of low-precision parameters fp32.

        torch casts every floating state tensor to its parameter's dtype on load, which would
        silently turn ``fp32_optimizer_states`` into bf16/fp16 states after a checkpoint resume.
        """
        wide = {pid: {k: v for k, v in st.items()
                      if k != "step" and torch.is_tensor(v) and v.is_floating_point()}
                for pid, st in state_dict["state"].items() if isinstance(pid, int)}
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for pid, tensors in wide.items():
            if pid >= len(params) or params[pid] not in self.state:
                continue
            state = self.state[params[pid]]
            for key, saved in tensors.items():
                if key in state and state[key].dtype != saved.dtype:
                    state[key] = saved.to(device=params[pid].device, copy=True)

    @property
    def adam_w_mode(self) -> bool:
        """DeepSpeedCPUAdam's attribute name for the default ``adamw_mode``."""
        return bool(self.defaults["adamw_mode"])

    def _pool(self) -> AdamThreadPool:
        return AdamThreadPool.shared(self.num_threads or max(1, torch.get_num_threads()))

    def _kernel(self, items: Sequence[Item], amsgrad: bool) -> str:
        """The Adam family in use: settled on the first update's shapes (then kept)."""
        switch = self.kernel_switch
        if switch.kernel is None:
            p, m = items[0][0], items[0][2]
            shape = shape_of([it[0].numel() for it in items], p.device, p.dtype, m.dtype, pooled=True,
                             chunk_numel=self.chunk_numel)
            switch.settle(self, choose_adam_kernel(switch.setting, shape, amsgrad=amsgrad, source=switch.source,
                                                   pool=self._pool(), chunk_numel=self.chunk_numel), "measured")
        return switch.kernel  # type: ignore[return-value]

    def _state_for(self, key: Any, p: torch.Tensor, amsgrad: bool) -> dict[str, Any]:
        state = self.state[key]
        if len(state) == 0:
            dtype = torch.float32 if self.fp32_optimizer_states and p.is_floating_point() \
                and p.element_size() < 4 else p.dtype
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        if not torch.is_tensor(state["step"]):  # a DeepSpeed state_dict holds an int
            state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
        if amsgrad and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(state["exp_avg_sq"])
        return state

    def _group_items(self, group: dict[str, Any], keys: Callable[[int, torch.Tensor], Any]) -> list[Item]:
        items: list[Item] = []
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if p.device.type != "cpu":
                raise RuntimeError(
                    f"CPUAdam.step() updates CPU parameters, got one on {p.device}; enable "
                    f"'offload_optimizer': {{'device': 'cpu'}} in the ZeRO config, or drive "
                    f"device parameters through step_subgroups()")
            if p.grad.is_sparse:
                raise RuntimeError("CPUAdam does not support sparse gradients")
            state = self._state_for(keys(i, p), p, group["amsgrad"])
            state["step"] += 1
            items.append((p, p.grad, state["exp_avg"], state["exp_avg_sq"],
                          state.get("max_exp_avg_sq"), state["step"]))
        return items

    def _run(self, items: Sequence[Item], hp: AdamHyperParams) -> None:
        # Cut into sub-groups of <= sub_group_size elements; each is one pipeline stage.
        if not items:
            return
        kernel = self._kernel(items, hp.amsgrad)
        stage: list[Item] = []
        numel = 0
        for item in items:
            if stage and numel + item[0].numel() > self.sub_group_size:
                adam_update(stage, hp, pool=self._pool(), chunk_numel=self.chunk_numel, kernel=kernel)
                stage, numel = [], 0
            stage.append(item)
            numel += item[0].numel()
        if stage:
            adam_update(stage, hp, pool=self._pool(), chunk_numel=self.chunk_numel, kernel=kernel)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter that has a gradient (CPU parameters only)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            items = self._group_items(group, lambda i, p: p)
            self._run(items, AdamHyperParams.from_group(group))
        return loss

    @torch.no_grad()
    def step_subgroup(self, subgroup_id: int, closure: Callable[[], Any] | None = None) -> Any:
        """DeepSpeed's ``step_subgroup``: update the params now in the groups with the state of
        ``subgroup_id`` (ZeRO-3 swaps one flat fp32 partition into the groups at a time)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            items = self._group_items(group, lambda i, p: subgroup_id if i == 0 else (subgroup_id, i))
            self._run(items, AdamHyperParams.from_group(group))
        return loss

    @torch.no_grad()
    def step_subgroups(
        self,
        subgroups: Sequence[SubGroup],
        *,
        group_index: int = 0,
        copies: SyncCopies | CudaStreamCopies | None = None,
    ) -> None:
        """Update explicit sub-group buffers with ``param_groups[group_index]``'s hyper-parameters,
        pipelining device copies (see :mod:`~zerospeed.ops.adam.subgroup_pipeline`).

        Each sub-group's ``step`` is incremented. The buffers are the caller's (e.g. ZeRO's
        offloaded flat partitions); the optimizer keeps no state for them.
        """
        group = self.param_groups[group_index]
        hp = AdamHyperParams.from_group(group)
        if hp.amsgrad and any(sg.max_exp_avg_sq is None for sg in subgroups):
            raise ValueError("amsgrad needs max_exp_avg_sq in every sub-group")
        pool = self._pool()
        if not subgroups:
            return
        kernel = self._kernel([(sg.param, sg.grad, sg.exp_avg, sg.exp_avg_sq, sg.max_exp_avg_sq, sg.step)
                               for sg in subgroups], hp.amsgrad)

        def update(sg: SubGroup) -> None:
            sg.step += 1
            adam_update([(sg.param, sg.grad, sg.exp_avg, sg.exp_avg_sq, sg.max_exp_avg_sq, sg.step)],
                        hp, pool=pool, chunk_numel=self.chunk_numel, kernel=kernel)

        run_subgroup_pipeline(subgroups, update, copies)


#: DeepSpeed's name, for ``from zerospeed.ops.adam import DeepSpeedCPUAdam`` drop-in imports.
DeepSpeedCPUAdam = CPUAdam
