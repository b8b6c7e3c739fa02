"""Turns a scheduled ragged batch into flat tensors, runs the model, returns logits.

Owns the KV cache tensors. One forward serves any mix of prefill chunks and
multi-token decode positions; logits are computed only where they are asked for.
"""
from __future__ import annotations

import torch

from specd.engine.kv_memory import zeroed
from specd.engine.model.attention import AttentionMetadata
from specd.engine.model.decoder import CausalLM
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
        self.kv_caches = [(zeroed(shape, dtype, device), zeroed(shape, dtype, device)) for _ in range(cfg.num_layers)]

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
        tree = self._tree_metadata(batch, max_q) if any(e.tree_parents is not None for e in batch) else {}
        if tree:
            positions = tree.pop("positions")
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
            **tree,
        )
        if not self.capture_layers:
            self.features = None
            return self.model(tok, positions, meta, self.kv_caches, logits_rows)
        logits, self.features = self.model(tok, positions, meta, self.kv_caches, logits_rows, self.capture_layers)
        return logits

    def _tree_metadata(self, batch: list[ScheduledSeq], max_q: int) -> dict:
        """AttentionMetadata's tree fields and the RoPE positions [T] of a step with trees: a
        tree token's position is tree_base + its depth (a parent of -1 hangs it on the context)."""
        B = len(batch)
        A = max(len(e.tree_parents) for e in batch if e.tree_parents is not None)
        base, positions = [], []
        anc = torch.zeros(B, max_q, A, dtype=torch.bool)
        path = torch.zeros(B, max_q, A, dtype=torch.long)
        pos2d = []
        for b, e in enumerate(batch):
            start, n = e.seq.num_computed_tokens, e.num_new_tokens
            rows = list(range(start, start + n))
            if e.tree_parents is None:
                base.append(start + n)
                positions += rows
            else:
                tb, parents = e.tree_base, e.tree_parents
                if tb + len(parents) != start + n or tb > start:
                    raise ValueError("a tree's new tokens must be its last tree tokens")
                depth, lineage = [], []  # per tree token: depth, ancestors-or-self (root first)
                for a, p in enumerate(parents):
                    if not -1 <= p < a:
                        raise ValueError(f"tree parent {p} of token {a} does not point backwards")
                    depth.append(0 if p < 0 else depth[p] + 1)
                    lineage.append(([] if p < 0 else lineage[p]) + [a])
                base.append(tb)
                for r in range(n):
                    a = start - tb + r
                    anc[b, r, lineage[a]] = True
                    path[b, r, : len(lineage[a])] = torch.tensor(lineage[a]) + tb
                rows = [tb + depth[start - tb + r] for r in range(n)]
                positions += rows
            pos2d.append(rows + list(range(start + n, start + max_q)))  # padded rows: slot order
        dev = self.device
        return dict(positions=torch.tensor(positions, device=dev), tree_base=torch.tensor(base, device=dev),
                    tree_anc=anc.to(dev), tree_path=path.to(dev), tree_pos_2d=torch.tensor(pos2d, device=dev))

    def copy_kv(self, src_slots: list[int], dst_slots: list[int]) -> None:
        """KV commit of an accepted tree path: move the K/V of src_slots into dst_slots, every
        layer (gathered before it is written, so the two may overlap)."""
        if not src_slots:
            return
        src = torch.tensor(src_slots, device=self.device)
        dst = torch.tensor(dst_slots, device=self.device)
        for k_cache, v_cache in self.kv_caches:
            for cache in (k_cache, v_cache):
                flat = cache.view(-1, *cache.shape[2:])
                flat.index_copy_(0, dst, flat.index_select(0, src))

    def _contiguous_start(self, batch: list[ScheduledSeq], context_len: int) -> int | None:
        if len(batch) != 1:
            return None
        table = batch[0].seq.block_table[: -(-context_len // self.block_size)]
        return table[0] * self.block_size if table == list(range(table[0], table[0] + len(table))) else None
