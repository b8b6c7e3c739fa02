"""Paged attention for a ragged batch of decode, verify and prefill-chunk queries, in Triton.

The GPU counterpart of specd.engine.model.attention.paged_attention (the torch path, which
gathers each sequence's K/V out of the paged cache and runs SDPA on a padded batch). Here
one program per (query token, head) walks the blocks of its sequence straight from the
cache through the block table, with an online softmax in float32, so nothing is gathered or
padded: a verify row of [last token, d1..dk] and a decode row cost what their context costs.

Token t of the flattened batch belongs to sequence token_seq[t] at absolute position
token_pos[t]; it sees the keys at positions <= token_pos[t] (and > token_pos[t] - window
with a sliding window). Its own K/V must already be in the cache (write_kv runs first), as
on the torch path.

Token trees: a tree token at position p = tree_base + depth sees the context before tree_base
and its ancestors-or-self, one per depth. The kernel walks logical positions 0..p in the same
tiles as a chain and maps each position >= tree_base to the key of the row's ancestor at that
depth (tree_path), so a tree row's keys, tiles and arithmetic are exactly those of the same
tokens decoded as a chain: the accepted path's rows have the bits of decoding them one by one
(batch-invariant mode, specd/engine/exactness.py). Chain and tree rows load their keys through
the same per-key gather and share every arithmetic step after it. Tested against that path under TRITON_INTERPRET=1 on CPU
(tests/kernels/test_paged_attention.py); importing this module needs Triton.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr, token_seq_ptr, token_pos_ptr, tables_ptr, tree_base_ptr, path_ptr,
    q_stride_t, q_stride_h, out_stride_t, out_stride_h,
    cache_stride_block, cache_stride_slot, cache_stride_head, table_stride, path_stride,
    scale, window,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_TREE: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    kv_head = h // GROUP
    b = tl.load(token_seq_ptr + t)
    pos = tl.load(token_pos_ptr + t)
    d = tl.arange(0, D)
    slot = tl.arange(0, BLOCK)
    q = tl.load(q_ptr + t * q_stride_t + h * q_stride_h + d).to(tl.float32)
    first_key = pos * 0
    if HAS_WINDOW:
        first_key = tl.maximum(pos - window + 1, 0)
    tree_base = pos + 1  # no position is remapped
    if HAS_TREE:
        tree_base = tl.load(tree_base_ptr + t)
    m = tl.full([], float("-inf"), tl.float32)
    denom = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([D], dtype=tl.float32)
    for j in range(first_key // BLOCK, pos // BLOCK + 1):
        key_pos = j * BLOCK + slot  # logical positions of this tile
        visible = (key_pos <= pos) & (key_pos >= first_key)
        key = key_pos
        if HAS_TREE:  # a tree position holds the row's ancestor at that depth
            in_tree = visible & (key_pos >= tree_base)
            key = tl.where(in_tree, tl.load(path_ptr + t * path_stride + (key_pos - tree_base), mask=in_tree,
                                            other=0), key_pos)
        block = tl.load(tables_ptr + b * table_stride + key // BLOCK)
        offsets = (block * cache_stride_block + (key % BLOCK) * cache_stride_slot
                   + kv_head * cache_stride_head)[:, None] + d[None, :]
        k = tl.load(k_ptr + offsets).to(tl.float32)  # [BLOCK, D]
        s = tl.sum(k * q[None, :], axis=1) * scale
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        rescale = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        v = tl.load(v_ptr + offsets).to(tl.float32)
        denom = denom * rescale + tl.sum(p, axis=0)
        acc = acc * rescale + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    out = acc / denom
    tl.store(out_ptr + t * out_stride_t + h * out_stride_h + d, out.to(out_ptr.dtype.element_ty))


def paged_attention_triton(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    token_seq: torch.Tensor,  # [T] int64: the sequence (row of block_tables) of each token
    token_pos: torch.Tensor,  # [T] int64: its absolute position
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    scale: float,
    window: int | None = None,
    tree_base: torch.Tensor | None = None,  # [T] int64: where each token's tree starts (> its position: none)
    tree_path: torch.Tensor | None = None,  # [T, A] int64: key index of its ancestor at each depth
) -> torch.Tensor:  # [T, H, D], q's dtype
    T, H, D = q.shape
    _, block_size, hkv, _ = k_cache.shape
    if H % hkv or D & (D - 1) or block_size & (block_size - 1):
        raise ValueError(f"paged_attention_triton needs heads % kv_heads == 0 and power-of-two head_dim and "
                         f"block_size, got H={H}, Hkv={hkv}, D={D}, block_size={block_size}")
    out = torch.empty_like(q)
    if T == 0:
        return out
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and q.stride(-1) == 1
    has_tree = tree_base is not None
    if has_tree:
        tree_path = tree_path.contiguous()
    _paged_attention_kernel[(T, H)](
        out, q, k_cache, v_cache, token_seq, token_pos, block_tables,
        tree_base if has_tree else token_pos, tree_path if has_tree else token_pos,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        tree_path.stride(0) if has_tree else 0,
        scale, window or 0,
        GROUP=H // hkv, BLOCK=block_size, D=D, HAS_WINDOW=window is not None, HAS_TREE=has_tree,
    )
    return out
