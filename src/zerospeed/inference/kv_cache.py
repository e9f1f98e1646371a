"""The paged KV cache: fixed-size blocks, a free-list allocator with reference counts, prefix
sharing of identical full blocks, and copy-on-write.

Memory layout: one tensor ``[num_layers, 2, num_blocks * block_size, kv_heads, head_dim]`` (a flat
slot axis; ``slot = block * block_size + offset``), allocated once. Its size is exactly
``kv_cache_bytes = 2 * num_layers * num_blocks * block_size * kv_heads * head_dim * element_size``
(see :func:`kv_cache_bytes`), checked by the tests.

Prefix sharing: a block that is full and whose K/V is computed is *sealed* under a hash of
``(hash of the previous block, its tokens)``, so a hash names the whole prefix up to the block's
end. A new sequence's prompt looks up its full blocks by that chain and takes a reference on each
hit instead of recomputing it. Freed blocks keep their hash and go to the back of the free list
(least recently used are reused first), so a later request with the same prefix (a shared system
prompt) still finds them until the space is needed. A write into a block that another sequence
also references (only possible when a whole prompt was found cached and its last token is
recomputed to get logits) first copies the block (copy-on-write).
"""

from __future__ import annotations

from collections import OrderedDict

import torch


def kv_cache_bytes(num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                   dtype: torch.dtype) -> int:
    return 2 * num_layers * num_blocks * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class NoFreeBlocks(RuntimeError):
    """The allocator is empty; the scheduler preempts a sequence and retries."""


class BlockAllocator:
    """Hands out block ids; owns reference counts and the prefix hash table. Pure bookkeeping (no
    tensors) so the scheduler can be tested without a model."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._ref = [0] * num_blocks
        self._hash_of: dict[int, int] = {}
        self._block_of: dict[int, int] = {}
        self.num_prefix_hits = 0  # blocks taken from the prefix table instead of recomputed

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, block: int) -> int:
        return self._ref[block]

    def allocate(self) -> int:
        if not self._free:
            raise NoFreeBlocks()
        block, _ = self._free.popitem(last=False)
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._block_of[h]
        self._ref[block] = 1
        return block

    def free(self, block: int) -> None:
        if self._ref[block] <= 0:
            raise RuntimeError(f"block {block} freed twice")
        self._ref[block] -= 1
        if self._ref[block] == 0:
            self._free[block] = None

    def share(self, block: int) -> int:
        """Take one more reference on an allocated ``block`` (a forked sequence reading the same
        K/V; a write to it is copied first, see the scheduler's copy-on-write)."""
        if self._ref[block] <= 0:
            raise RuntimeError(f"block {block} is not allocated")
        self._ref[block] += 1
        return block

    def seal(self, block: int, prefix_hash: int) -> None:
        """Record that ``block`` holds the K/V of the prefix named by ``prefix_hash``."""
        if prefix_hash in self._block_of or block in self._hash_of:
            return
        self._hash_of[block] = prefix_hash
        self._block_of[prefix_hash] = block

    def lookup(self, prefix_hash: int) -> int | None:
        """Take a reference on the block holding this prefix, if any."""
        block = self._block_of.get(prefix_hash)
        if block is None:
            return None
        if self._ref[block] == 0:
            del self._free[block]
        self._ref[block] += 1
        self.num_prefix_hits += 1
        return block


def chain_hash(previous: int | None, tokens: list[int]) -> int:
    return hash((previous, tuple(tokens)))


class KVCache:
    """The cache tensors. ``k[layer]`` / ``v[layer]`` are ``[num_slots, kv_heads, head_dim]`` views."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.data = torch.zeros(num_layers, 2, num_blocks * block_size, kv_heads, head_dim, dtype=dtype,
                                device=device)
        self.k = [self.data[i, 0] for i in range(num_layers)]
        self.v = [self.data[i, 1] for i in range(num_layers)]
        self.nbytes = self.data.numel() * self.data.element_size()

    def copy_block(self, src: int, dst: int) -> None:
        bs = self.block_size
        self.data[:, :, dst * bs:(dst + 1) * bs] = self.data[:, :, src * bs:(src + 1) * bs]
