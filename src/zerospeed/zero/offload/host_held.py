"""NVMe swap of a host-held optimizer's states (Muon, Lion, SGD, NAdam, ... with ``device: nvme``).

Host-held buckets (:func:`~zerospeed.zero.optimizer_kinds.host_held_optimizer`) are stepped by the
user's own optimizer on host-memory fp32 masters. With ``offload_optimizer.device: nvme`` their
element-wise states (every fp32 tensor of ``optimizer.state[master]`` with the master's element
count: Muon's ``momentum_buffer``, Lion's ``exp_avg``, NAdam's ``exp_avg`` / ``exp_avg_sq``...) live
in swap files (:class:`~zerospeed.zero.offload.swap.NvmeStateSwapper`) between steps. Scalars
(``step``, NAdam's ``mu_product``) and any state of another dtype or size stay in memory, where the
memory report counts them; the masters stay in host memory (the optimizer and the parameter refresh
read them there).

:meth:`HostHeldNvmeStates.resident` puts the swapped states back into ``optimizer.state`` for a block
(the step, a checkpoint save or load) and on exit writes them back (``write_back``) and drops them
from memory. The optimizer creates its states at its first step (or a checkpoint load brings them),
so the swap files are laid out at the first exit that finds states: one swapper per distinct set of
state names (an optimizer with several kinds of groups, e.g. MuAdamW's Muon and Adam halves, keeps
different states per group), rebuilt if that set ever changes. Values go through the files
unchanged (fp32 in, fp32 out), so a run equals the ``device: cpu`` run bit for bit.

The step (:meth:`HostHeldNvmeStates.step`): the element-wise optimizers step one swap group (consecutive
buckets up to ``sub_group_size`` elements) at a time on views of the swap buffers, the next groups read
and the previous ones written back meanwhile, so their states take only the swap buffers
(``buffer_count`` groups per state name) in memory. Muon steps all its buckets at once (one exchange of
whole matrices per step), so its states are all read before its step and written back after it, as
the first step of any optimizer (its states are made by that step) and checkpoints do.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch

from zerospeed.zero.offload.swap import NvmeStateSwapper


def _swappable(state: dict[str, Any], numel: int) -> tuple[str, ...]:
    """Names of the states of one master that go to the swap files (sorted)."""
    return tuple(sorted(k for k, v in state.items()
                        if torch.is_tensor(v) and v.dtype == torch.float32 and v.device.type == "cpu"
                        and v.numel() == numel and v.dim() <= 1 and numel > 1))


class HostHeldNvmeStates:
    """The element-wise states of the host-held masters ``masters``, swapped to ``config.nvme_path``."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: Any, aio_config: Any, rank: int,
                 masters: Sequence[torch.Tensor], sub_group_size: int = 1_000_000_000,
                 fast_paths: Any = None) -> None:
        self.optimizer = optimizer
        self.config = config
        self.aio_config = aio_config
        self.rank = rank
        self.masters = list(masters)
        self.sub_group_size = int(sub_group_size)
        self.direct_io = getattr(fast_paths, "direct_io", "auto")
        #: per master: its swapped state names and (swapper, sub-group index), or None while in memory
        self.places: list[tuple[tuple[str, ...], NvmeStateSwapper, int] | None] = [None] * len(self.masters)
        self.swappers: dict[tuple[str, ...], NvmeStateSwapper] = {}

    # -- layout -----------------------------------------------------------------------------------
    def _plan(self) -> list[tuple[str, ...]]:
        return [_swappable(self.optimizer.state.get(m, {}), m.numel()) for m in self.masters]

    def _layout(self, plan: list[tuple[str, ...]]) -> None:
        """(Re)build the swap files for ``plan`` (state names per master)."""
        self._close_swappers()
        members: dict[tuple[str, ...], list[int]] = {}
        for i, keys in enumerate(plan):
            if keys:
                members.setdefault(keys, []).append(i)
        for keys, idx in members.items():
            swapper = NvmeStateSwapper(self.config.nvme_path, keys, [self.masters[i].numel() for i in idx],
                                       self.aio_config, int(self.config.buffer_count), self.rank,
                                       pin_memory=bool(self.config.pin_memory) and torch.cuda.is_available(),
                                       group_numel=self.sub_group_size, direct_io=self.direct_io)
            self.swappers[keys] = swapper
            for j, i in enumerate(idx):
                self.places[i] = (keys, swapper, j)

    # -- residency --------------------------------------------------------------------------------
    @contextmanager
    def resident(self, write_back: bool = True) -> Iterator[None]:
        """Swapped states in ``optimizer.state`` for the block; on exit written back (``write_back``)
        and dropped from memory. Reads happen before the block, so a read error leaves nothing half-done."""
        self.read_in()
        try:
            yield
        finally:
            self.write_out(write_back)

    def read_in(self) -> None:
        for swapper in self.swappers.values():
            swapper.check_files()  # a deleted or replaced swap file is named before anything is read
        for master, place in zip(self.masters, self.places):
            if place is not None:
                keys, swapper, j = place
                self.optimizer.state[master].update(swapper.read(j))

    def write_out(self, write_back: bool) -> None:
        """Store the states (``write_back``; a load or a step may have created or replaced them) and
        drop the swapped ones from memory."""
        if write_back:
            plan = self._plan()
            if plan != [p[0] if p is not None else () for p in self.places]:
                self._layout(plan)
        for master, place in zip(self.masters, self.places):
            if place is None:
                continue
            keys, swapper, j = place
            state = self.optimizer.state.get(master, {})
            if write_back:
                swapper.write(j, {k: state.get(k) for k in keys})
            for k in keys:
                state.pop(k, None)

    # -- the step ---------------------------------------------------------------------------------
    def step(self) -> None:
        """The optimizer's step with the swapped states in memory (see the module docstring).

        Muon (its orthogonalisation exchanges whole matrices between ranks in one collective per step)
        and the first step (no swap files yet) read every state in, step once and write them back. The
        element-wise optimizers step one swap group at a time on views of the swap buffer (only that
        group's masters carry a ``.grad``, so the optimizer skips the others), while the swapper reads
        the next groups and writes the previous ones back: memory stays at the swap buffers."""
        if not self.swappers or getattr(self.optimizer, "needs_whole_matrices", False):
            self.read_in()
            try:
                self.optimizer.step()
            finally:
                self.write_out(write_back=True)
            return
        grads = [m.grad for m in self.masters]
        for m, place in zip(self.masters, self.places):
            if place is not None:  # masters without swapped states step with the other buckets
                m.grad = None
        others = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        other_grads = [p.grad for p in others]
        try:
            self.optimizer.step()
            for p in others:  # stepped: the group steps below see only their own members' gradients
                p.grad = None
            for swapper in self.swappers.values():
                self._grouped(swapper, grads)
        finally:
            for p, g in zip(others, other_grads):
                p.grad = g
            for m, g in zip(self.masters, grads):
                m.grad = g

    def _grouped(self, swapper: NvmeStateSwapper, grads: list[torch.Tensor | None]) -> None:
        members = [i for i, p in enumerate(self.places) if p is not None and p[1] is swapper]  # by sub-group

        def update(_g: int, states: dict[int, dict[str, torch.Tensor]]) -> None:
            for j, views in states.items():
                master = self.masters[members[j]]
                self.optimizer.state[master].update(views)
                master.grad = grads[members[j]]
            try:
                self.optimizer.step()
            finally:
                for j, views in states.items():
                    master = self.masters[members[j]]
                    master.grad = None
                    state = self.optimizer.state[master]
                    for k, view in views.items():
                        now = state.pop(k, None)
                        if now is not None and now is not view:  # an optimizer that replaced the tensor
                            view.copy_(now.reshape(-1))

        swapper.run(update)

    # -- accounting and lifecycle -----------------------------------------------------------------
    def memory_bytes(self) -> dict[str, int]:
        """``offload_buffers``: the swap buffers; ``optimizer_states_nvme``: the swap files."""
        return {"offload_buffers": sum(s.buffer_bytes for s in self.swappers.values()),
                "optimizer_states_nvme": sum(s.disk_bytes for s in self.swappers.values())}

    @property
    def swap_folders(self) -> list[str]:
        return [s.folder for s in self.swappers.values()]

    def _close_swappers(self) -> None:
        for s in self.swappers.values():
            s.close()
        self.swappers = {}
        self.places = [None] * len(self.masters)

    def close(self) -> None:
        self._close_swappers()
