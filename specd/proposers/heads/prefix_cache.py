"""A chain head's prefix cache: its KV over the pairs of histories it has seen, in blocks of
BLOCK pairs, so a new sequence that repeats one (the next turn of a conversation, a shared
system prompt) starts from there and the verifier sends feature rows only past it.

Pair p is (the target's row at position p, token p + 1) at head position p; its K and V depend
on nothing else, so a block of pairs is keyed by the tokens up to the last one it reads: block
b (pairs [bB, (b+1)B)) by the chained hash of tokens [0, (b+1)B]. The salt names the head (its
weights and the target's layers it reads). Blocks are stored when a sequence is released and
evicted least recently used beyond max_bytes.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from specd.engine.block_manager import block_hashes
from specd.proposers.heads.layer import KVCache

BLOCK = 16


class HeadPrefixCache:
    def __init__(self, max_bytes: int, salt: bytes):
        self.max_bytes, self.salt = max_bytes, salt
        self.blocks: OrderedDict[bytes, list[tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()  # per layer
        self.bytes = 0
        self.hits = self.pairs_reused = 0

    def _hashes(self, tokens: list[int], num_blocks: int) -> list[bytes]:
        if num_blocks <= 0:
            return []
        # tokens[0] seeds the chain; block b then hashes tokens [bB + 1, (b+1)B], the ones its pairs read
        return block_hashes(tokens[1: 1 + num_blocks * BLOCK], BLOCK, self.salt + str(tokens[0]).encode())

    def held(self, tokens: list[int], max_pairs: int) -> list[bytes]:
        """The hashes of the leading blocks held for this history, up to max_pairs pairs."""
        out = []
        for h in self._hashes(tokens, max_pairs // BLOCK):
            if h not in self.blocks:
                break
            out.append(h)
        return out

    def restore(self, kv: KVCache, held: list[bytes]) -> int:
        """Write the held blocks into an empty cache; the pairs restored."""
        if not held:
            return 0
        for layer in range(len(kv.k)):
            kv.write(layer, torch.cat([self.blocks[h][layer][0] for h in held]),
                     torch.cat([self.blocks[h][layer][1] for h in held]))
        for h in held:
            self.blocks.move_to_end(h)
        kv.length += len(held) * BLOCK
        self.hits += 1
        self.pairs_reused += len(held) * BLOCK
        return len(held) * BLOCK

    def store(self, tokens: list[int], kv: KVCache) -> None:
        """Keep the whole blocks of a sequence's committed pairs that are not held yet."""
        pairs = min(kv.length, len(tokens) - 1)
        for b, h in enumerate(self._hashes(tokens, pairs // BLOCK)):
            if h in self.blocks:
                self.blocks.move_to_end(h)
                continue
            rows = slice(b * BLOCK, (b + 1) * BLOCK)
            block = [(k[rows].clone(), v[rows].clone()) for k, v in zip(kv.k, kv.v)]
            self.blocks[h] = block
            self.bytes += sum(k.nbytes + v.nbytes for k, v in block)
        while self.bytes > self.max_bytes and self.blocks:
            _, block = self.blocks.popitem(last=False)
            self.bytes -= sum(k.nbytes + v.nbytes for k, v in block)
