"""Counting of collectives: calls, elements and bytes per collective type.

Every collective in zerospeed goes through :mod:`zerospeed.comm.collectives`, which records it
here. The counts are the basis of the comms logger and of tests that assert "one collective per
bucket" and "about 2Ψ elements communicated per step".

Conventions (``elements`` is the size of the *logical* message, the full unsharded tensor):

* ``all_reduce``: the tensor's numel.
* ``reduce_scatter``: the input's numel (the full tensor being reduced).
* ``all_gather``: the output's numel (the full tensor being assembled).
* ``broadcast`` / ``send`` / ``recv``: the tensor's numel.

``traffic_elements()`` weighs these by what a bandwidth-optimal (ring) algorithm moves per rank,
up to the (N-1)/N factor: an all-reduce is a reduce-scatter plus an all-gather, so it counts twice.
That is the quantity the ZeRO paper's "2Ψ per step for stages 0-2, 3Ψ for stage 3" refers to.

``intra_host_bytes`` / ``inter_host_bytes`` split what this rank *sent* by link (exact (N-1)/N figures of the
algorithm that ran, see :mod:`zerospeed.comm.links`): bytes to ranks on its own host, and bytes that crossed to
another host. A host's network link carries, per direction, the sum of ``inter_host_bytes`` over its ranks; the
ZeRO formula per host link (rx + tx, 2 hosts) is 2Ψ x 4 B for stages 1-2 and 3Ψ x 4 B for stage 3 (fp32).
"""

from __future__ import annotations

from dataclasses import dataclass, field

_TRAFFIC_WEIGHT = {"all_reduce": 2}


@dataclass
class OpStats:
    """Totals for one collective type."""

    count: int = 0
    elements: int = 0
    bytes: int = 0
    wire_elements: int = 0  # what the algorithm actually sent per rank, up to the (N-1)/N factor
    intra_host_bytes: int = 0  # sent by this rank to ranks on its host (exact, with the (N-1)/N factor)
    inter_host_bytes: int = 0  # sent by this rank across to other hosts


@dataclass
class CommCounter:
    """Per-collective-type totals since the last :meth:`reset`."""

    ops: dict[str, OpStats] = field(default_factory=dict)
    generation: int = 0  # bumped by reset(), so a reader holding an old snapshot can tell

    def record(self, op: str, numel: int, element_size: int, wire_numel: int | None = None,
               links: tuple[int, int] = (0, 0)) -> None:
        """Count one ``op`` over a logical message of ``numel`` elements.

        ``wire_numel`` is what the chosen algorithm moves per rank (default: the ring figure,
        twice the message for an all-reduce, once for the others; 0 for a world of one).
        ``links`` is ``(intra_host_bytes, inter_host_bytes)`` this rank sent.
        """
        stats = self.ops.setdefault(op, OpStats())
        stats.count += 1
        stats.elements += numel
        stats.bytes += numel * element_size
        stats.wire_elements += numel * _TRAFFIC_WEIGHT.get(op, 1) if wire_numel is None else wire_numel
        stats.intra_host_bytes += links[0]
        stats.inter_host_bytes += links[1]

    def count(self, op: str) -> int:
        return self.ops[op].count if op in self.ops else 0

    def elements(self, op: str) -> int:
        return self.ops[op].elements if op in self.ops else 0

    def traffic_elements(self, ops: tuple[str, ...] = ("all_reduce", "reduce_scatter", "all_gather")) -> int:
        """Elements moved per rank by ring algorithms (all-reduce counted twice), summed over ``ops``."""
        return sum(self.elements(op) * _TRAFFIC_WEIGHT.get(op, 1) for op in ops)

    def link_bytes(self) -> tuple[int, int]:
        """``(intra_host_bytes, inter_host_bytes)`` this rank sent, over every op."""
        return (sum(s.intra_host_bytes for s in self.ops.values()), sum(s.inter_host_bytes for s in self.ops.values()))

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {op: {"count": s.count, "elements": s.elements, "bytes": s.bytes, "wire_elements": s.wire_elements,
                     "intra_host_bytes": s.intra_host_bytes, "inter_host_bytes": s.inter_host_bytes}
                for op, s in self.ops.items()}

    def reset(self) -> None:
        self.ops.clear()
        self.generation += 1


#: The process-wide counter every wrapper in :mod:`zerospeed.comm.collectives` records into.
COUNTER = CommCounter()
