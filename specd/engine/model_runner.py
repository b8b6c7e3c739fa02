"""Turns a scheduled ragged batch into flat tensors, runs the model, returns logits.

Owns the KV cache tensors. One forward serves any mix of prefill chunks and
multi-token decode positions; logits are computed only where they are asked for.
"""
from __future__ import annotations

import torch

from specd.engine.attention import AttentionMetadata
from specd.engine.model import CausalLM
from specd.engine.scheduler import ScheduledSeq


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype):
        cfg = model.config
        self.model, self.device, self.block_size = model, device, block_size
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        # Zero-filled, not empty: padded key slots are masked, but 0 * NaN garbage would still be NaN.
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_layers)
        ]

    @staticmethod
    def kv_bytes_per_block(model: CausalLM, block_size: int, dtype: torch.dtype) -> int:
        cfg = model.config
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """Logits [sum(num_logits), vocab], float32, in batch order."""
        token_ids, positions, slots, logits_idx = [], [], [], []
        query_lens, context_lens, tables = [], [], []
        bs = self.block_size
        for entry in batch:
            seq, n = entry.seq, entry.num_new_tokens
            start = seq.num_computed_tokens
            num_committed = n - len(entry.draft_token_ids)
            token_ids.extend(seq.token_ids[start:start + num_committed])
            token_ids.extend(entry.draft_token_ids)
            pos = range(start, start + n)
            positions.extend(pos)
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            row_end = len(positions)
            logits_idx.extend(range(row_end - entry.num_logits, row_end))
            query_lens.append(n)
            context_lens.append(start + n)
            tables.append(table)
        meta = self._metadata(positions, slots, query_lens, context_lens, tables)
        dev = self.device
        return self.model(
            torch.tensor(token_ids, device=dev),
            torch.tensor(positions, device=dev),
            meta,
            self.kv_caches,
            torch.tensor(logits_idx, device=dev, dtype=torch.long),
        )

    def _metadata(self, positions, slots, query_lens, context_lens, tables) -> AttentionMetadata:
        dev = self.device
        max_q, max_c = max(query_lens), max(context_lens)
        width = -(-max_c // self.block_size)
        block_tables = torch.tensor([t[:width] + [0] * (width - len(t[:width])) for t in tables], device=dev)
        padded = any(q != max_q for q in query_lens)
        # Absolute position of every padded query row: context_len - query_len + row.
        rows = torch.arange(max_q, device=dev)[None, :]
        starts = torch.tensor([c - q for c, q in zip(context_lens, query_lens)], device=dev)[:, None]
        query_index = None
        if padded:
            query_index = torch.cat([torch.arange(q, device=dev) + b * max_q for b, q in enumerate(query_lens)])
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=dev, dtype=torch.long),
            block_tables=block_tables,
            query_lens=query_lens,
            context_lens=context_lens,
            query_index=query_index,
            max_query_len=max_q,
            max_context_len=max_c,
            positions_2d=starts + rows,
        )
