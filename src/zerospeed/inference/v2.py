"""DeepSpeed FastGen's engine-level API (``InferenceEngineV2``) on our engine:
``build_hf_engine(path, engine_config)`` then ``put(uids, tokens) -> logits``, ``query``,
``flush``, ``can_schedule``.

Here the caller is the scheduler (as in DeepSpeed-MII): ``put`` runs one ragged forward over the
given tokens of the given sequences (new uids start a sequence, known ones continue it) and returns
the last-token logits of each, ``[len(uids), vocab]`` float32, in the order given. The KV blocks
are our paged cache's; ``flush(uid)`` returns them. ``put`` checks (``do_checks``) the per-forward
limits ``max_ragged_batch_size`` / ``max_ragged_sequence_count``, ``max_context`` and
``max_tracked_sequences`` and raises ``ValueError`` naming the limit; when the cache is full it
raises :class:`~zerospeed.inference.kv_cache.NoFreeBlocks` naming the uid, before running anything
(``query`` / ``can_schedule`` tell beforehand what fits).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from zerospeed.config.inference import RaggedInferenceEngineConfig, load_ragged_config
from zerospeed.inference.kv_cache import NoFreeBlocks


class _State:
    __slots__ = ("num_cached", "blocks")

    def __init__(self) -> None:
        self.num_cached = 0
        self.blocks: list[int] = []


class InferenceEngineV2:
    def __init__(self, engine: Any, config: RaggedInferenceEngineConfig) -> None:
        self.engine = engine
        self.config = config
        self._state: dict[int, _State] = {}

    @property
    def free_blocks(self) -> int:
        return self.engine.allocator.num_free

    @property
    def n_kv_cache_blocks(self) -> int:
        return self.engine.allocator.num_blocks

    @property
    def model(self) -> Any:
        return self.engine.model

    def _blocks_for(self, st: _State, n: int) -> int:
        return max(-(-(st.num_cached + n) // self.engine.block_size) - len(st.blocks), 0)

    def query(self, uid: int, max_request_tokens: int, max_request_blocks: int) -> tuple[int, int]:
        """How many of ``max_request_tokens`` new tokens of ``uid`` fit now, and the blocks they take."""
        st = self._state.get(uid, _State())
        bs = self.engine.block_size
        blocks = min(max_request_blocks, self.free_blocks)
        room = (len(st.blocks) + blocks) * bs - st.num_cached
        room = min(room, self.config.state_manager.max_context - st.num_cached)
        tokens = max(0, min(max_request_tokens, room))
        return tokens, self._blocks_for(st, tokens)

    def can_schedule(self, uids: Iterable[int], lengths: Iterable[int]) -> bool:
        uids, lengths = list(uids), list(lengths)
        sm = self.config.state_manager
        if len(uids) > sm.max_ragged_sequence_count or sum(lengths) > sm.max_ragged_batch_size:
            return False
        new = sum(1 for u in uids if u not in self._state)
        if len(self._state) + new > sm.max_tracked_sequences:
            return False
        need = sum(self._blocks_for(self._state.get(u, _State()), n) for u, n in zip(uids, lengths))
        return need <= self.free_blocks

    def put(self, batch_uids: Iterable[int], batch_tokens: Iterable[Any], do_checks: bool = True) -> torch.Tensor:
        uids = list(batch_uids)
        toks = [t.tolist() if isinstance(t, torch.Tensor) else list(t) for t in batch_tokens]
        if len(uids) != len(toks):
            raise ValueError(f"put: {len(uids)} uids but {len(toks)} token lists")
        if len(set(uids)) != len(uids):
            raise ValueError("put: a uid appears twice in one batch")
        for u, t in zip(uids, toks):
            if not t:
                raise ValueError(f"put: uid {u} has no tokens")
            bad = [x for x in t if not 0 <= x < self.engine.spec.vocab_size]
            if bad:
                raise ValueError(f"put: uid {u}: token id {bad[0]} is outside the vocabulary")
        sm = self.config.state_manager
        if do_checks:
            if len(uids) > sm.max_ragged_sequence_count:
                raise ValueError(f"put: {len(uids)} sequences exceed max_ragged_sequence_count "
                                 f"({sm.max_ragged_sequence_count})")
            total = sum(len(t) for t in toks)
            if total > sm.max_ragged_batch_size:
                raise ValueError(f"put: {total} tokens exceed max_ragged_batch_size ({sm.max_ragged_batch_size})")
            new = sum(1 for u in uids if u not in self._state)
            if len(self._state) + new > sm.max_tracked_sequences:
                raise ValueError(f"put: more than max_tracked_sequences ({sm.max_tracked_sequences}) sequences")
            for u, t in zip(uids, toks):
                length = self._state[u].num_cached if u in self._state else 0
                if length + len(t) > min(sm.max_context, self.engine.max_model_len):
                    raise ValueError(f"put: uid {u} would reach {length + len(t)} tokens, more than max_context "
                                     f"({min(sm.max_context, self.engine.max_model_len)})")
        states = [self._state.get(u) or _State() for u in uids]
        need = sum(self._blocks_for(st, len(t)) for st, t in zip(states, toks))
        if need > self.free_blocks:
            raise NoFreeBlocks(f"put: the batch needs {need} new KV blocks, {self.free_blocks} are free "
                               f"(flush finished uids, or ask query()/can_schedule() first)")
        for u, st, t in zip(uids, states, toks):
            self._state[u] = st
            for _ in range(self._blocks_for(st, len(t))):
                st.blocks.append(self.engine.allocator.allocate())
        # decodes (one token) first, as the ragged forward expects; logits come back in caller order
        order = sorted(range(len(uids)), key=lambda i: len(toks[i]) != 1)
        ids, items, rows, t_end = [], [], [], 0
        for i in order:
            ids.extend(toks[i])
            items.append((states[i].num_cached, len(toks[i]), states[i].blocks))
            t_end += len(toks[i])
            rows.append(t_end - 1)
        num_decodes = sum(1 for i in order if len(toks[i]) == 1)
        logits = self.engine.run_forward(ids, items, num_decodes, [], rows)
        for st, t in zip(states, toks):
            st.num_cached += len(t)
        out = torch.empty_like(logits)
        out[torch.tensor(order)] = logits
        return out

    def flush(self, uid: int) -> None:
        st = self._state.pop(uid, None)
        if st is None:
            raise ValueError(f"flush: uid {uid} is not tracked")
        for b in st.blocks:
            self.engine.allocator.free(b)

    def get_remaining_block_capacity(self, uid: int) -> int:
        st = self._state.get(uid, _State())
        return len(st.blocks) * self.engine.block_size - st.num_cached


def build_hf_engine(path: str, engine_config: RaggedInferenceEngineConfig | dict | None = None,
                    debug_level: int = 0, **engine_kwargs: Any) -> InferenceEngineV2:
    """DeepSpeed's ``build_hf_engine``: an HF folder and a RaggedInferenceEngineConfig (or its dict)."""
    from zerospeed.inference.build import build_engine

    cfg = load_ragged_config(engine_config)
    sm = cfg.state_manager
    kw: dict[str, Any] = dict(dtype=cfg.dtype, block_size=cfg.block_size, max_num_seqs=sm.max_ragged_sequence_count,
                              max_num_batched_tokens=sm.max_ragged_batch_size, tensor_parallel=cfg.tensor_parallel.tp_size,
                              enable_prefix_caching=False, greedy_head=cfg.greedy_head, cpu_kernels=cfg.cpu_kernels)
    if sm.memory_config.mode == "allocate":
        kw["num_blocks"] = sm.memory_config.size
    else:  # reserve: what is free minus `size`, no more than the tracked sequences can fill
        import psutil

        from zerospeed.inference.build import resolve_dtype
        from zerospeed.inference.kv_cache import kv_cache_bytes
        from zerospeed.inference.models.spec import load_spec

        spec = load_spec(path)
        context = min(sm.max_context, spec.max_position_embeddings)
        kw["max_model_len"] = context
        per_token = kv_cache_bytes(spec.num_layers, 1, 1, spec.num_kv_heads, spec.head_dim, resolve_dtype(cfg.dtype))
        free = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else psutil.virtual_memory().available
        kw["kv_cache_memory"] = max(min(free - sm.memory_config.size,
                                        per_token * context * min(sm.max_tracked_sequences, sm.max_ragged_sequence_count)),
                                    1)
    kw.update(engine_kwargs)
    engine = build_engine(path, **kw)
    return InferenceEngineV2(engine, cfg)
