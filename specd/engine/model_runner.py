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
        # Hidden states hidden-state drafters need (see CausalLM.forward); after each run,
        # `features` holds them for every token of the step, in batch order.
        self.capture_layers: tuple[int, ...] = ()
        self.features: torch.Tensor | None = None
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
        token_ids, query_lens, context_lens, logits_idx = [], [], [], []
        for entry in batch:
            seq, n = entry.seq, entry.num_new_tokens
            start = seq.num_computed_tokens
            token_ids += seq.token_slice(start, start + n - len(entry.draft_token_ids))
            token_ids += entry.draft_token_ids
            logits_idx += range(len(token_ids) - entry.num_logits, len(token_ids))
            query_lens.append(n)
            context_lens.append(start + n)
        B, T, N = len(batch), len(token_ids), len(logits_idx)
        width = -(-max(context_lens) // self.block_size)
        tables = [t for e in batch for t in e.seq.block_table[:width] + [0] * (width - len(e.seq.block_table[:width]))]
        # The step's integer metadata crosses to the device as one tensor, in one copy.
        host = torch.tensor(token_ids + query_lens + context_lens + logits_idx + tables, dtype=torch.long)
        tok, qlens, ctx, logits_rows, flat_tables = host.to(self.device, non_blocking=True).split([T, B, B, N, B * width])
        block_tables = flat_tables.view(B, width)
        # Per token: its sequence, its row within the sequence's query, its absolute position
        # and its cache slot, all vectorised (no per-token Python, no host sync).
        seq_of = torch.repeat_interleave(torch.arange(B, device=self.device), qlens, output_size=T)
        row = torch.arange(T, device=self.device) - (torch.cumsum(qlens, 0) - qlens)[seq_of]
        positions = (ctx - qlens)[seq_of] + row
        slots = block_tables[seq_of, positions // self.block_size] * self.block_size + positions % self.block_size
        max_q, max_c = max(query_lens), max(context_lens)
        meta = AttentionMetadata(
            slot_mapping=slots,
            block_tables=block_tables,
            query_lens=query_lens,
            context_lens=context_lens,
            # Each token's place in the padded [B * max_q] layout; None when nothing is padded.
            query_index=None if all(q == max_q for q in query_lens) else seq_of * max_q + row,
            max_query_len=max_q,
            max_context_len=max_c,
            # Absolute position of every padded query row: context_len - query_len + row.
            positions_2d=(ctx - qlens)[:, None] + torch.arange(max_q, device=self.device)[None, :],
            contiguous_start=self._contiguous_start(batch, max_c),
            token_seq=seq_of,
            token_pos=positions,
        )
        if not self.capture_layers:
            self.features = None
            return self.model(tok, positions, meta, self.kv_caches, logits_rows)
        logits, self.features = self.model(tok, positions, meta, self.kv_caches, logits_rows, self.capture_layers)
        return logits

    def _contiguous_start(self, batch: list[ScheduledSeq], context_len: int) -> int | None:
        if len(batch) != 1:
            return None
        table = batch[0].seq.block_table[: -(-context_len // self.block_size)]
        return table[0] * self.block_size if table == list(range(table[0], table[0] + len(table))) else None
