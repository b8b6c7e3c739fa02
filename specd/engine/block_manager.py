"""Paged KV cache bookkeeping: fixed-size blocks, per-sequence tables, and the prefix cache.

Plain Python, no torch: the model runner turns block tables into slot indices.

Prefix caching (vLLM's automatic prefix caching, in the same shape): a block whose every token's
KV is committed gets a content hash, the hash of the block before it and its own tokens, so equal
hashes mean equal token prefixes and, on one model, equal KV. A new (or preempted) sequence takes
the cached blocks of its longest hashed prefix instead of computing them. Blocks are reference
counted: a shared block is only read (a sequence writes at positions >= its computed tokens, and
those lie in its own, unshared blocks: speculative rollback frees only blocks past them). A block
no sequence holds keeps its KV and hash until its slot is needed: free blocks are taken first,
then the least recently released cached one is evicted.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass

from specd.engine.sequence import Sequence


def block_hashes(token_ids: list[int], block_size: int, salt: bytes = b"") -> list[bytes]:
    """Content hashes of the full blocks of token_ids, chained: each covers its block and everything
    before it. `salt` seeds the chain: the model's (the weights' fingerprint tells models apart), or
    the hash of the block before token_ids[0] when extending a chain."""
    hashes, prev = [], salt
    for i in range(len(token_ids) // block_size):
        prev = hashlib.blake2b(prev + array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes(),
                               digest_size=16).digest()
        hashes.append(prev)
    return hashes


@dataclass
class PrefixCacheStats:
    """Counters since start, in tokens like vLLM's prefix_cache_queries / _hits."""

    queries: int = 0  # prompt (and recomputed) tokens looked up on admission
    hits: int = 0  # of those, tokens whose KV came from the cache
    evictions: int = 0  # cached blocks whose KV was dropped for a new one


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False, salt: bytes = b""):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.block_size = block_size
        self.num_total_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.salt = salt
        self._free: deque[int] = deque(range(num_blocks))  # holding nothing reusable
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}  # block -> content hash, for cached blocks
        self._block_of: dict[bytes, int] = {}  # content hash -> block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, held by none; oldest first
        self.stats = PrefixCacheStats()
        self.on_evict = None  # callable(block): the scheduler drops what it kept beside the block

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can get now: free ones and cached ones no sequence holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_of)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache --------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks of seq's longest cached prefix (seq holds no blocks yet). At least its
        last token is left to compute: a step must produce its next token's logits."""
        if not self.enable_prefix_caching or seq.block_table:
            return []
        limit = (len(seq) - 1) // self.block_size
        self._hash_blocks(seq, limit)
        hit = []
        for h in seq.block_hashes[:limit]:
            block = self._block_of.get(h)
            if block is None:
                break
            hit.append(block)
        return hit

    def commit(self, seq: Sequence) -> list[tuple[int, int]]:
        """Cache seq's blocks that became full of committed KV; returns (index in its table, block)
        of those newly cached. A block equal to one already cached stays private (freed as usual)."""
        if not self.enable_prefix_caching:
            return []
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if full <= seq.num_cached_blocks:
            return []
        self._hash_blocks(seq, full)
        added = []
        for i in range(seq.num_cached_blocks, full):
            block, h = seq.block_table[i], seq.block_hashes[i]
            if block not in self._hash_of and h not in self._block_of:
                self._hash_of[block], self._block_of[h] = h, block
                added.append((i, block))
        seq.num_cached_blocks = full
        return added

    def _hash_blocks(self, seq: Sequence, n: int) -> None:
        """Extend seq.block_hashes to its first n blocks, hashing only the blocks not hashed yet."""
        have = len(seq.block_hashes)
        if n > have:
            tokens = seq.token_slice(have * self.block_size, n * self.block_size)
            seq.block_hashes += block_hashes(tokens, self.block_size, seq.block_hashes[-1] if have else self.salt)

    def reset_prefix_cache(self) -> int:
        """Drop every cached block no sequence holds (returns how many); held ones stay."""
        dropped = list(self._evictable)
        self._evictable.clear()
        for block in dropped:
            self._forget(block)
            self._free.append(block)
        return len(dropped)

    # -- allocation ----------------------------------------------------------
    def allocate(self, seq: Sequence, num_tokens: int, prefix: list[int] = ()) -> bool:
        """Grow seq's table to hold num_tokens tokens, starting from the cached blocks `prefix`
        (match_prefix's, when seq holds none: their tokens count as computed); False, and no
        change, if blocks run out."""
        extra = self.blocks_needed(num_tokens) - len(seq.block_table) - len(prefix)
        reclaimable = sum(1 for b in prefix if self._refs[b] == 0)  # would leave the evictable pool
        if max(extra, 0) > self.num_free_blocks - reclaimable:
            return False
        if prefix or (self.enable_prefix_caching and not seq.block_table):
            self.stats.queries += len(seq)
            self.stats.hits += len(prefix) * self.block_size
        for block in prefix:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
            seq.block_table.append(block)
        if prefix:
            seq.num_cached_blocks = len(prefix)
            seq.num_computed_tokens = len(prefix) * self.block_size
        for _ in range(max(extra, 0)):
            seq.block_table.append(self._take())
        return True

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int, copy_slots) -> bool:
        """child (holding no blocks) gets parent's KV of its first num_tokens tokens: the full blocks
        shared (a reference each; no sequence writes into a full block), the last partial block
        copied into a block of its own through copy_slots(src slots, dst slots). False, and no change,
        if no block is free for the copy."""
        full, rest = divmod(num_tokens, self.block_size)
        if rest and not self.num_free_blocks:
            return False
        for block in parent.block_table[:full]:
            self._refs[block] += 1
            child.block_table.append(block)
        if rest:
            block = self._take()
            child.block_table.append(block)
            src = parent.block_table[full] * self.block_size
            copy_slots(list(range(src, src + rest)), list(range(block * self.block_size, block * self.block_size + rest)))
        child.block_hashes = list(parent.block_hashes[:full])
        child.num_cached_blocks = min(parent.num_cached_blocks, full)
        child.num_computed_tokens = num_tokens
        return True

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep blocks for the first num_tokens tokens only (roll back rejected drafts)."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        # Last block first: a cached tail is then evicted before its head, which more requests share.
        # Uncached blocks return in order, so a later sequence tends to get consecutive blocks again:
        # attention then reads a lone sequence's K/V as a view of the cache (specd/engine/model/attention.py).
        for block in reversed(seq.block_table):
            self._refs[block] -= 1
            if self._refs[block] == 0 and block in self._hash_of:
                self._evictable[block] = None
        self._free.extend(b for b in seq.block_table if self._refs[b] == 0 and b not in self._hash_of)
        seq.block_table = []
        seq.num_cached_blocks = 0

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def _take(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            self._forget(block)
            self.stats.evictions += 1
        self._refs[block] = 1
        return block

    def _forget(self, block: int) -> None:
        del self._block_of[self._hash_of.pop(block)]
        if self.on_evict is not None:
            self.on_evict(block)
