"""The Triton paged-attention kernel against the engine's torch path (gather + SDPA), on a
ragged batch of decode, verify and prefill-chunk rows over shuffled, non-contiguous blocks
(TRITON_INTERPRET=1 on CPU, natively on a GPU)."""
from __future__ import annotations

import pytest
import torch

from specd.engine.attention import AttentionMetadata, paged_attention

triton_kernel = pytest.importorskip("specd.kernels.paged_attention_triton")


def _case(query_lens, context_lens, heads, kv_heads, dtype, block_size=16, head_dim=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    widths = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(widths) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()  # scattered blocks, as after churn
    tables, used = [], 0
    for w in widths:
        tables.append(order[used:used + w] + [0] * (max(widths) - w))
        used += w
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=g).to(dtype)
    token_seq = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
    token_pos = torch.cat([torch.arange(c - n, c) for n, c in zip(query_lens, context_lens)])
    return q, k_cache, v_cache, token_seq, token_pos, torch.tensor(tables)


def _torch_path(q, k_cache, v_cache, token_pos, tables, query_lens, context_lens, scale, window):
    B, max_q = len(query_lens), max(query_lens)
    padded = any(n != max_q for n in query_lens)
    rows = torch.arange(max_q)[None, :]
    query_index = None
    if padded:
        query_index = torch.cat([torch.arange(n) + b * max_q for b, n in enumerate(query_lens)])
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(token_pos), dtype=torch.long), block_tables=tables,
        query_lens=list(query_lens), context_lens=list(context_lens), query_index=query_index,
        max_query_len=max_q, max_context_len=max(context_lens),
        positions_2d=torch.tensor([c - n for n, c in zip(query_lens, context_lens)])[:, None] + rows)
    return paged_attention(q, k_cache, v_cache, meta, scale, window)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3)])  # MHA and GQA (SmolLM2's 9/3)
def test_kernel_matches_the_torch_path(dtype, tol, window, heads, kv_heads):
    query_lens, context_lens = [1, 5, 3, 1, 17], [1, 40, 19, 33, 17]  # decode, verify, chunk, prefill
    q, kc, vc, seq, pos, tables = _case(query_lens, context_lens, heads, kv_heads, dtype)
    scale = 64 ** -0.5
    ours = triton_kernel.paged_attention_triton(q, kc, vc, seq, pos, tables, scale, window)
    ref = _torch_path(q, kc, vc, pos, tables, query_lens, context_lens, scale, window)
    assert ours.dtype == dtype and ours.shape == ref.shape
    torch.testing.assert_close(ours.float(), ref.float(), atol=tol, rtol=tol)


def test_kernel_reads_only_its_own_sequence():
    """Poisoning every key the kernel must not see changes nothing; poisoning one it must see does."""
    query_lens, context_lens = [2, 3], [10, 20]
    q, kc, vc, seq, pos, tables = _case(query_lens, context_lens, 4, 2, torch.float32)
    base = triton_kernel.paged_attention_triton(q, kc, vc, seq, pos, tables, 0.125)
    kc2, vc2 = kc.clone(), vc.clone()
    visible = torch.zeros(kc.shape[:2], dtype=torch.bool)
    for b, c in enumerate(context_lens):
        for p in range(c):
            visible[tables[b, p // 16], p % 16] = True
    kc2[~visible], vc2[~visible] = 1e4, 1e4
    torch.testing.assert_close(triton_kernel.paged_attention_triton(q, kc2, vc2, seq, pos, tables, 0.125), base)
    kc2[tables[1, 0], 0] += 5.0  # position 0 of sequence 1: visible to all its queries
    assert not torch.allclose(triton_kernel.paged_attention_triton(q, kc2, vc2, seq, pos, tables, 0.125)[2:], base[2:])


def test_engine_greedy_is_unchanged_with_the_kernel(family_dir, monkeypatch):
    """The engine with SPECD_PAGED_ATTENTION=triton decodes the same greedy tokens, batched."""
    from specd import LLM, SamplingParams

    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 11, 7)]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    plain = [o.token_ids for o in LLM(family_dir, dtype="float32").generate(prompts, sp)]
    monkeypatch.setenv("SPECD_PAGED_ATTENTION", "triton")
    calls, kernel_fn = [], triton_kernel.paged_attention_triton
    monkeypatch.setattr(triton_kernel, "paged_attention_triton", lambda *a, **k: calls.append(1) or kernel_fn(*a, **k))
    kernel = [o.token_ids for o in LLM(family_dir, dtype="float32").generate(prompts, sp)]
    assert calls and kernel == plain
