"""Attention over a flattened ragged batch, reading K/V from the paged cache.

Every sequence in a step contributes `query_len` new tokens (a prefill chunk, one
decode token, or later the last token plus k drafts) and attends to its whole
context: cached tokens plus the new ones. This file is the one place that knows
how: on a GPU, the Triton kernel of kernels/paged_attention_triton.py, which walks the block
tables directly, one program per (token, head), so a row's arithmetic never depends on the rest
of the step (cuBLAS's batched matmuls and softmax choose their kernels by shape: on an H200 the
torch path changed 15 of 16 prompts' greedy tokens in a batch, bench/results/gpu_exact.md);
elsewhere torch over a padded batch (a lone sequence with consecutive blocks reads its K/V as a
view of the cache). SPECD_PAGED_ATTENTION=torch or =triton picks one explicitly.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    # T = total new tokens in the step, B = sequences, Q = max query len, C = max context len.
    slot_mapping: torch.Tensor  # [T] cache slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor  # [B, max_blocks] padded with 0
    query_lens: list[int]  # [B]
    context_lens: list[int]  # [B] cached + new tokens
    query_index: torch.Tensor | None  # [T] position of each token in the padded [B * Q] layout; None = no padding
    max_query_len: int
    max_context_len: int
    positions_2d: torch.Tensor  # [B, Q] absolute position of each (padded) query row
    # First cache slot of a lone sequence whose blocks are consecutive: its K/V are then a view
    # of the cache, with no per-layer gather (the common case at batch 1, see BlockManager).
    contiguous_start: int | None = None
    token_seq: torch.Tensor | None = None  # [T] batch row of each new token (the Triton kernel's input)
    token_pos: torch.Tensor | None = None  # [T] absolute position of each new token
    # Token trees (None: every sequence is a chain). A sequence's tree tokens sit in the cache in
    # slot order from tree_base on (A = max tree tokens): the verifier's [last token, nodes ..],
    # or a drafter's nodes so far. A tree row sees the context before tree_base and its own
    # ancestors-or-self among the tree tokens; its RoPE position is tree_base + depth.
    tree_base: torch.Tensor | None = None  # [B] slot-order index of the first tree token (context_len: no tree)
    tree_anc: torch.Tensor | None = None  # [B, Q, A] bool: query row sees tree token a
    tree_path: torch.Tensor | None = None  # [B, Q, A] int64: key index of the row's ancestor at depth t (0 padded)
    tree_pos_2d: torch.Tensor | None = None  # [B, Q] RoPE position of each padded query row
    # Per step, derived once: mask() and compact_keys() by window, the Triton kernel's per-token tree inputs.
    _masks: dict = field(default_factory=dict)

    def mask(self, window: int | None) -> torch.Tensor | None:
        """[B, 1, Q, C] boolean (True = attend), built once per window per step."""
        if window is None and self.max_query_len == 1 and min(self.context_lens) == self.max_context_len:
            return None  # decode with equal contexts: every cached key is visible
        if window not in self._masks:
            device = self.block_tables.device
            keys = torch.arange(self.max_context_len, device=device)  # [C]
            ctx = torch.tensor(self.context_lens, device=device)  # [B]
            qpos = self.positions_2d[:, :, None]  # [B, Q, 1]
            m = (keys[None, None, :] <= qpos) & (keys[None, None, :] < ctx[:, None, None])
            if window is not None:
                m &= qpos - keys[None, None, :] < window
            # Padded query rows would see no key at all and give NaN; let them see key 0.
            qlens = torch.tensor(self.query_lens, device=device)
            pad_rows = torch.arange(self.max_query_len, device=device)[None, :] >= qlens[:, None]
            m[..., 0] |= pad_rows
            if self.tree_base is not None:
                # Keys from tree_base on are tree tokens: visible only to their descendants. (A
                # sliding window here still counts slot order, not tree depth: no windowed model
                # has been run with trees.)
                rel = keys[None, :] - self.tree_base[:, None]  # [B, C]
                A = self.tree_anc.shape[-1]
                anc = self.tree_anc.gather(2, rel.clamp(0, A - 1)[:, None, :].expand(-1, self.max_query_len, -1))
                m &= (rel < 0)[:, None, :] | anc
            self._masks[window] = m.unsqueeze(1)
        return self._masks[window]

    def compact_keys(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """For tree steps in batch-invariant mode: per query row, the key index of each key in
        the layout a plain decode of that token would see (context, then its ancestors at
        consecutive positions) -> (key_index [B, Q, C] int64, mask [B, Q, C] bool). Masking the
        off-path keys in place would leave exact zeros between the terms of the row's reductions,
        which regroups their sums: not the plain bits. Built once per window per step."""
        if ("compact", window) not in self._masks:
            self._masks["compact", window] = self._compact_keys(window)
        return self._masks["compact", window]

    def _compact_keys(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.block_tables.device
        keys = torch.arange(self.max_context_len, device=device)  # [C]
        ctx = torch.tensor(self.context_lens, device=device)  # [B]
        rel = keys[None, None, :] - self.tree_base[:, None, None]  # [B, 1, C]
        A = self.tree_path.shape[-1]
        path = self.tree_path.gather(2, rel.clamp(0, A - 1).expand(-1, self.max_query_len, -1))  # [B, Q, C]
        key_index = torch.where(rel < 0, keys[None, None, :], path)
        qpos = self.tree_pos_2d[:, :, None]  # [B, Q, 1]
        m = (keys[None, None, :] <= qpos) & (keys[None, None, :] < ctx[:, None, None])
        if window is not None:
            m &= qpos - keys[None, None, :] < window
        qlens = torch.tensor(self.query_lens, device=device)
        m[..., 0] |= torch.arange(self.max_query_len, device=device)[None, :] >= qlens[:, None]
        return torch.where(m, key_index, 0), m


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
    # k_cache, v_cache [num_blocks, block_size, Hkv, D]; k, v [T, Hkv, D]; slots [T]
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slots, v)


def triton_attention_used(device: torch.device) -> bool:
    """Whether attention on this device runs the Triton kernel (default on CUDA where Triton imports)."""
    choice = os.environ.get("SPECD_PAGED_ATTENTION")
    if choice in ("torch", "triton"):
        return choice == "triton"
    if device.type != "cuda":
        return False
    try:
        import specd.kernels.paged_attention_triton  # noqa: F401
    except ImportError:
        return False
    return True


def _triton_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int | None):
    from specd.kernels.paged_attention_triton import paged_attention_triton

    tree_base = tree_path = None
    if meta.tree_base is not None:  # per token: its sequence's tree base and its row's ancestors
        if "tree_tokens" not in meta._masks:
            B, Q, A = meta.tree_path.shape
            rows = meta.query_index if meta.query_index is not None else torch.arange(q.shape[0], device=q.device)
            meta._masks["tree_tokens"] = (meta.tree_base[meta.token_seq], meta.tree_path.view(B * Q, A)[rows])
        tree_base, tree_path = meta._masks["tree_tokens"]
    return paged_attention_triton(q, k_cache, v_cache, meta.token_seq, meta.token_pos, meta.block_tables,
                                  scale, window, tree_base, tree_path)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    invariant: bool = False,
) -> torch.Tensor:  # [T, H, D]
    if meta.token_seq is not None and triton_attention_used(q.device):
        return _triton_attention(q, k_cache, v_cache, meta, scale, window)
    B, Q, C = len(meta.query_lens), meta.max_query_len, meta.max_context_len
    T, H, D = q.shape
    hkv = k_cache.shape[2]
    if meta.contiguous_start is not None:
        s = meta.contiguous_start
        k = k_cache.view(-1, hkv, D)[s: s + C].unsqueeze(0)  # [1, C, Hkv, D]
        v = v_cache.view(-1, hkv, D)[s: s + C].unsqueeze(0)
    else:
        k = k_cache[meta.block_tables].view(B, -1, hkv, D)[:, :C]  # [B, C, Hkv, D]
        v = v_cache[meta.block_tables].view(B, -1, hkv, D)[:, :C]
    if meta.query_index is None:
        qp = q.view(B, Q, H, D)
    else:
        qp = q.new_zeros(B * Q, H, D).index_copy_(0, meta.query_index, q).view(B, Q, H, D)
    if invariant and meta.tree_base is not None:
        # Each row gets its own keys, gathered into the plain layout: one query per matmul, the
        # shape of a plain decode, so the row's bits are those of decoding it alone.
        key_index, m = meta.compact_keys(window)  # [B, Q, C]
        seq = torch.arange(k.shape[0], device=q.device)[:, None, None]  # [B or 1, 1, 1]
        kc = k[seq, key_index].reshape(B * Q, C, hkv, D)
        vc = v[seq, key_index].reshape(B * Q, C, hkv, D)
        out = invariant_attention(qp.reshape(B * Q, 1, H, D).transpose(1, 2), kc, vc, m.view(B * Q, 1, 1, C), scale)
        out = out.view(B, Q, H, D).transpose(1, 2)
    elif invariant:
        out = invariant_attention(qp.transpose(1, 2), k, v, meta.mask(window), scale)
    else:
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=meta.mask(window), scale=scale,
            enable_gqa=H != hkv,
        )  # [B, H, Q, D]
    out = out.transpose(1, 2).reshape(B * Q, H, D)
    return out if meta.query_index is None else out.index_select(0, meta.query_index)


def invariant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                        scale: float) -> torch.Tensor:
    """Attention whose every row is the same whatever else is computed with it.

    q [B, H, Q, D]; k, v [B, C, Hkv, D] (the cache's layout); mask [B, 1, Q, C] or None ->
    [B, H, Q, D] in q's dtype. Two float32 matmuls and a row-local softmax: each output row's
    reductions (over D, then over the keys) run in one fixed order whatever Q, the batch or the
    padding (masked keys add exact zeros), unlike SDPA's fused CPU kernel, whose splits follow
    the query count. K and V are converted straight into contiguous float32 operands
    ([B, Hkv, D, C] and [B, Hkv, C, D]): batched matmuls on strided views take a path ~10x
    slower on CPU, which made this mode cost 2x SDPA's attention at batch 16."""
    B, H, Q, D = q.shape
    hkv = k.shape[2]
    group = H // hkv
    kt = k.permute(0, 2, 3, 1).to(torch.float32, memory_format=torch.contiguous_format)
    vf = v.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
    scores = torch.matmul(q.float().reshape(B, hkv, group * Q, D), kt).mul_(scale)
    scores = scores.view(B, hkv, group, Q, -1)
    if mask is not None:
        scores.masked_fill_(~mask.view(B, 1, 1, Q, -1), float("-inf"))
    probs = scores.softmax(-1).view(B, hkv, group * Q, -1)
    return torch.matmul(probs, vf).view(B, H, Q, D).to(q.dtype)
