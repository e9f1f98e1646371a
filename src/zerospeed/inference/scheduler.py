"""Dynamic SplitFuse scheduling over the paged cache.

Each ``schedule()`` picks the tokens of one forward, within ``max_num_batched_tokens`` tokens
(DeepSpeed's ``max_ragged_batch_size``) and ``max_num_seqs`` sequences (``max_ragged_sequence_count``):

1. decodes first: every running sequence whose prompt is done contributes its one new token,
   oldest first; when there are any, the prompt tokens of this forward are further capped at
   ``max_prefill_tokens_with_decodes`` (a large prompt chunk would stall every decoding sequence
   for the whole forward: this cap bounds inter-token latency, at the cost of more forwards to
   admit a burst of prompts, i.e. throughput and time to first token);
2. then running sequences still in their prompt get the next chunk, as large as the budget left
   (long prompts are split across forwards);
3. then waiting requests, strictly first-in first-out, are admitted and their first chunk fused
   into the same forward until the token budget is full.

Prefill first (``prefill_first=True``, the default): while no running sequence has produced a token
yet (a burst of requests on an idle engine), prompts are computed up to, not including, their last
token, in full-budget forwards; a sequence whose prompt is done that far is *held*. When no prompt
work is left to schedule (all admitted prompts held, nothing more admissible), the held sequences
run their last prompt token together as one batch of decodes, which samples every first token in
the same forward. Without it, the first prompts to finish would start decoding while the rest of
the burst is still being prefilled, and every one of their inter-token gaps would carry a prompt
chunk (measured on bench/inference_bench.py: those mixed forwards set the p95 inter-token latency).
A burst's time to first token is then its whole prefill, which it also was before, give or take,
because the chunks of the later prompts slowed every early decode step. Once sequences are decoding,
later arrivals are not held (holding them would not spare the running sequences the prompt
chunks); they go through steps 2-3 under the cap of step 1. A request is admitted only when the
   free blocks can hold its whole remaining prompt (blocks found in the prefix table excepted),
   and no later request is admitted ahead of one that cannot: no request starves.

Decode K/V budget (``max_decode_kv_tokens``, the engine's ``max_decode_kv_bytes`` in tokens): a
waiting request is admitted only while the K/V that the running sequences will hold at their
longest, ``prompt + max_new_tokens`` tokens each, plus its own, stays within the budget, so that no
decode step reads more K/V than that (on CPU a decode step is bound by the bytes it reads: weights
plus every running sequence's K/V; see the engine for the default). It is checked in arrival order
and stops at the first request that does not fit, like the block check; a request is always
admitted when nothing runs, so none waits forever.

Cache pressure: when a running sequence needs a block and none is free, the newest running
sequence (possibly one already picked for this forward, which is then dropped from it) is
preempted: its blocks are freed and it goes back to the front of the waiting queue, in arrival
order, keeping its generated tokens; it is recomputed when readmitted (its freed blocks keep their
prefix hashes, so it often finds them again). When the sequence in need is itself the newest, it
is the one preempted. Since every request's prompt + max_new_tokens fits in the whole cache
(checked at admission by the engine), the oldest running sequence can always proceed: there is no
deadlock, and nothing is ever reset.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from zerospeed.inference.kv_cache import BlockAllocator, chain_hash
from zerospeed.inference.sequence import Sequence, Status


def _reserved_tokens(seq: Sequence) -> int:
    """The K/V tokens ``seq`` holds at its longest (its last decode step)."""
    return seq.prompt_len + seq.params.max_new_tokens


@dataclass
class ScheduledBatch:
    """This forward's work: ``items`` are ``(sequence, num_new_tokens)``, decodes first;
    ``copies`` are copy-on-write ``(src_block, dst_block)`` to apply to the cache before it."""

    items: list[tuple[Sequence, int]] = field(default_factory=list)
    num_decodes: int = 0
    copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)


class Scheduler:
    def __init__(self, allocator: BlockAllocator, max_num_batched_tokens: int, max_num_seqs: int,
                 enable_prefix_caching: bool = True, max_prefill_tokens_with_decodes: int | None = None,
                 prefill_first: bool = True, max_decode_kv_tokens: int | None = None) -> None:
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_prefill_tokens_with_decodes is not None and max_prefill_tokens_with_decodes < 1:
            raise ValueError(f"max_prefill_tokens_with_decodes must be >= 1 or None, got {max_prefill_tokens_with_decodes}")
        if max_decode_kv_tokens is not None and max_decode_kv_tokens < 1:
            raise ValueError(f"max_decode_kv_tokens must be >= 1 or None, got {max_decode_kv_tokens}")
        self.max_decode_kv_tokens = max_decode_kv_tokens
        self.max_prefill_tokens_with_decodes = max_prefill_tokens_with_decodes
        self.prefill_first = prefill_first
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.enable_prefix_caching = enable_prefix_caching
        self.waiting: list[Sequence] = []  # arrival order
        self.running: list[Sequence] = []  # arrival order
        self.num_preemptions = 0

    # -- queue management ------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def _insert_waiting(self, seq: Sequence) -> None:
        i = len(self.waiting)
        while i > 0 and self.waiting[i - 1].arrival > seq.arrival:
            i -= 1
        self.waiting.insert(i, seq)

    def free_blocks(self, seq: Sequence) -> None:
        for b in seq.blocks:
            self.allocator.free(b)
        seq.blocks = []
        seq.block_hashes = []
        seq.num_computed = 0

    def add_fork(self, seq: Sequence, parent: Sequence) -> None:
        """``seq`` (same prompt as ``parent``) waits for ``parent``'s prompt K/V and then shares its
        blocks (:meth:`_attach_forks`) instead of computing the prompt again; the last prompt
        token is computed by each sequence itself (as a decode), so the partly filled block that
        holds it is copied on write, never shared while written."""
        parent.forks.append(seq)

    def _attach_forks(self, parent: Sequence) -> None:
        bs = self.block_size
        shared = parent.prompt_len - 1  # positions whose K/V the forks read from the parent
        nb = -(-shared // bs)
        for seq in parent.forks:
            seq.blocks = [self.allocator.share(b) for b in parent.blocks[:nb]]
            seq.block_hashes = list(parent.block_hashes[:min(len(parent.block_hashes), nb)])
            seq.num_computed = shared
            seq.status = Status.RUNNING
            self.running.append(seq)
        parent.forks = []
        self.running.sort(key=lambda s: s.arrival)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and return its blocks."""
        if seq.forks and seq.num_computed < seq.prompt_len - 1:
            for f in seq.forks:  # its prompt was not computed: the forks compute it themselves
                self._insert_waiting(f)
            seq.forks = []
        elif seq.forks:
            self._attach_forks(seq)
        for other in self.waiting + self.running:  # a fork whose parent goes (abort) is its own
            if seq in getattr(other, "forks", ()):
                other.forks.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.free_blocks(seq)
        seq.status = Status.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.free_blocks(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._insert_waiting(seq)

    # -- block bookkeeping -------------------------------------------------------------------
    def _blocks_needed(self, seq: Sequence, n: int) -> int:
        """New blocks to write tokens ``[num_computed, num_computed + n)``, copy-on-write included."""
        bs = self.block_size
        need = -(-(seq.num_computed + n) // bs) - len(seq.blocks)
        j = seq.num_computed // bs
        if j < len(seq.blocks) and self.allocator.refcount(seq.blocks[j]) > 1:
            need += 1
        return max(need, 0)

    def _grow(self, seq: Sequence, n: int, batch: ScheduledBatch) -> None:
        """Allocate (the caller checked there are enough free blocks)."""
        bs = self.block_size
        j = seq.num_computed // bs
        if j < len(seq.blocks) and self.allocator.refcount(seq.blocks[j]) > 1:
            new = self.allocator.allocate()
            batch.copies.append((seq.blocks[j], new))
            self.allocator.free(seq.blocks[j])
            seq.blocks[j] = new
            del seq.block_hashes[j:]
        while len(seq.blocks) * bs < seq.num_computed + n:
            seq.blocks.append(self.allocator.allocate())

    def _reserve(self, seq: Sequence, n: int, batch: ScheduledBatch, picked: "OrderedDict[Sequence, int]") -> bool:
        """Make room for ``n`` tokens of running ``seq``, preempting newer running sequences.
        False when ``seq`` itself had to be preempted."""
        while self._blocks_needed(seq, n) > self.allocator.num_free:
            victim = self.running[-1]
            if victim is seq:
                self._preempt(seq)
                batch.preempted.append(seq)
                return False
            picked.pop(victim, None)
            self._preempt(victim)
            batch.preempted.append(victim)
        self._grow(seq, n, batch)
        return True

    def _prefix_hashes(self, seq: Sequence) -> list[int]:
        bs = self.block_size
        hashes, h = [], None
        for j in range(len(seq.tokens) // bs):
            h = chain_hash(h, seq.tokens[j * bs:(j + 1) * bs])
            hashes.append(h)
        return hashes

    def _admit(self, seq: Sequence) -> bool:
        """Take cached prefix blocks and check the rest of the prompt fits; False leaves it waiting."""
        bs = self.block_size
        hits: list[int] = []
        # a prompt being scored runs every position through the LM head: no cached prefix
        hashes = self._prefix_hashes(seq) if self.enable_prefix_caching and not seq.needs_prompt_logits else []
        for h in hashes:
            b = self.allocator._block_of.get(h)
            if b is None:
                break
            hits.append(b)
        total = -(-len(seq.tokens) // bs)
        free_hits = sum(1 for b in hits if self.allocator.refcount(b) == 0)
        # the last cached block is copied on write if the whole prompt was found
        cow = 1 if hits and len(hits) * bs >= len(seq.tokens) else 0
        if total - len(hits) + free_hits + cow > self.allocator.num_free:
            return False
        for h in hashes[:len(hits)]:
            seq.blocks.append(self.allocator.lookup(h))
            seq.block_hashes.append(h)
        seq.num_computed = min(len(hits) * bs, len(seq.tokens) - 1)
        seq.status = Status.RUNNING
        return True

    # -- the step ----------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        # "decoding": some running sequence has produced tokens and awaits its next one (with one token to compute,
        # or several: the tokens a grammar forced, appended by jump-forward, are never held as a prompt's)
        decoding = any(s.num_generated and s.num_computed >= s.prompt_len for s in self.running)
        hold = False
        if self.prefill_first and not decoding:
            # hold last tokens only when the prompts in sight do not all fit in this one forward
            pending = sum(s.num_remaining for s in self.running)
            for s in self.waiting:  # stops as soon as the answer is known (a long queue costs nothing)
                if pending > self.max_num_batched_tokens:
                    break
                pending += len(s.tokens)
            hold = pending > self.max_num_batched_tokens
        batch = self._schedule(hold, cap=decoding)
        if hold and not batch.items and not batch.preempted:
            batch = self._schedule(False, cap=False)  # nothing left to prefill: the held sequences decode
        return batch

    def _schedule(self, hold: bool, cap: bool) -> ScheduledBatch:
        """One forward's work. ``hold``: no decodes, and each prompt stops one token short of its
        end; ``cap``: prompt tokens are capped at ``max_prefill_tokens_with_decodes``."""
        batch = ScheduledBatch()
        picked: OrderedDict[Sequence, int] = OrderedDict()
        budget = self.max_num_batched_tokens
        keep = 1 if hold else 0  # prompt tokens left for the decode phase

        def spent() -> int:
            return sum(picked.values())

        for seq in ([] if hold else [s for s in self.running if s.num_remaining == 1]):
            if seq not in self.running or len(picked) >= self.max_num_seqs or spent() + 1 > budget:
                continue
            if self._reserve(seq, 1, batch, picked):
                picked[seq] = 1
        if cap and picked and self.max_prefill_tokens_with_decodes is not None:
            # decodes are running: cap the prompt tokens fused with them (inter-token latency)
            budget = min(budget, spent() + self.max_prefill_tokens_with_decodes)
        for seq in [s for s in self.running if s.num_remaining > 1]:
            if seq not in self.running or len(picked) >= self.max_num_seqs:
                continue
            n = min(seq.num_remaining - keep, budget - spent())
            if n <= 0:
                if budget - spent() <= 0:
                    break
                continue
            if self._reserve(seq, n, batch, picked):
                picked[seq] = n
        reserved = sum(_reserved_tokens(s) for s in self.running) if self.max_decode_kv_tokens is not None else 0
        while self.waiting and len(self.running) < self.max_num_seqs and len(picked) < self.max_num_seqs:
            n_left = budget - spent()
            if n_left <= 0:
                break
            seq = self.waiting[0]
            if self.max_decode_kv_tokens is not None and self.running and \
                    reserved + _reserved_tokens(seq) > self.max_decode_kv_tokens:
                break  # the decode K/V budget is full; FIFO: nothing overtakes this request
            if not self._admit(seq):
                break
            reserved += _reserved_tokens(seq)
            self.waiting.pop(0)
            self.running.append(seq)
            self.running.sort(key=lambda s: s.arrival)
            n = min(seq.num_remaining - keep, n_left)
            if n > 0:  # a one-token prompt (or one found whole in the prefix cache) is held at once
                self._grow(seq, n, batch)
                picked[seq] = n
        decodes = [(s, n) for s, n in picked.items() if s.num_remaining == 1]
        prefills = [(s, n) for s, n in picked.items() if s.num_remaining != 1]
        batch.items = decodes + prefills
        batch.num_decodes = len(decodes)
        return batch

    def after_forward(self, batch: ScheduledBatch) -> None:
        """Advance ``num_computed`` and seal newly full blocks into the prefix table."""
        bs = self.block_size
        for seq, n in batch.items:
            seq.num_computed += n
            if seq.forks and seq.num_computed >= seq.prompt_len - 1:
                self._attach_forks(seq)
            if not self.enable_prefix_caching:
                continue
            full = seq.num_computed // bs
            h = seq.block_hashes[-1] if seq.block_hashes else None
            for j in range(len(seq.block_hashes), full):
                h = chain_hash(h, seq.tokens[j * bs:(j + 1) * bs])
                seq.block_hashes.append(h)
                self.allocator.seal(seq.blocks[j], h)
