"""The Triton paged-attention kernel against the engine's torch path (gather + SDPA), on a
ragged batch of decode, verify and prefill-chunk rows over shuffled, non-contiguous blocks
(TRITON_INTERPRET=1 on CPU, natively on a GPU)."""
from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

from specd.engine.model.attention import AttentionMetadata, paged_attention

triton_kernel = pytest.importorskip("specd.kernels.paged_attention_triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # natively on a GPU, interpreted elsewhere


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
    k_cache = torch.randn(shape, generator=g).to(DEVICE, dtype)
    v_cache = torch.randn(shape, generator=g).to(DEVICE, dtype)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=g).to(DEVICE, dtype)
    token_seq = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
    token_pos = torch.cat([torch.arange(c - n, c) for n, c in zip(query_lens, context_lens)])
    return q, k_cache, v_cache, token_seq.to(DEVICE), token_pos.to(DEVICE), torch.tensor(tables, device=DEVICE)


def _torch_path(q, k_cache, v_cache, token_pos, tables, query_lens, context_lens, scale, window):
    B, max_q = len(query_lens), max(query_lens)
    padded = any(n != max_q for n in query_lens)
    rows = torch.arange(max_q, device=DEVICE)[None, :]
    query_index = None
    if padded:
        query_index = torch.cat([torch.arange(n) + b * max_q for b, n in enumerate(query_lens)]).to(DEVICE)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(token_pos), dtype=torch.long, device=DEVICE), block_tables=tables,
        query_lens=list(query_lens), context_lens=list(context_lens), query_index=query_index,
        max_query_len=max_q, max_context_len=max(context_lens),
        positions_2d=torch.tensor([c - n for n, c in zip(query_lens, context_lens)], device=DEVICE)[:, None] + rows)
    with mock.patch.dict(os.environ, {"SPECD_PAGED_ATTENTION": "torch"}):  # on a GPU the default is the kernel
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
    visible = torch.zeros(kc.shape[:2], dtype=torch.bool, device=DEVICE)
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
    monkeypatch.setenv("SPECD_PAGED_ATTENTION", "torch")
    plain = [o.token_ids for o in LLM(family_dir, dtype="float32", device=DEVICE).generate(prompts, sp)]
    monkeypatch.setenv("SPECD_PAGED_ATTENTION", "triton")
    calls, kernel_fn = [], triton_kernel.paged_attention_triton
    monkeypatch.setattr(triton_kernel, "paged_attention_triton", lambda *a, **k: calls.append(1) or kernel_fn(*a, **k))
    kernel = [o.token_ids for o in LLM(family_dir, dtype="float32", device=DEVICE).generate(prompts, sp)]
    assert calls and kernel == plain


def _tree_case(dtype, heads=4, kv_heads=2, head_dim=64, block_size=16):
    """Sequence 0: a 21-token context, then a tree [root, a, s1, b, s2, c] (parents -1, 0, 0, 1, 1, 3)
    in slots 21..26; sequence 1: a chain whose context holds the same 21 tokens followed by the path
    root, a, b, c in consecutive slots (blocks scattered differently)."""
    g = torch.Generator().manual_seed(3)
    ctx, parents = 21, [-1, 0, 0, 1, 1, 3]
    path = [0, 1, 3, 5]  # tree tokens on root -> a -> b -> c
    shape = (8, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    tables = torch.tensor([[5, 2], [7, 0]])

    def slot(b, p):
        return int(tables[b, p // block_size]) * block_size + p % block_size

    k_flat, v_flat = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    for p in range(ctx):
        k_flat[slot(1, p)], v_flat[slot(1, p)] = k_flat[slot(0, p)], v_flat[slot(0, p)]
    for depth, node in enumerate(path):
        k_flat[slot(1, ctx + depth)], v_flat[slot(1, ctx + depth)] = k_flat[slot(0, ctx + node)], v_flat[slot(0, ctx + node)]
    depth_of, lineage = [], []
    for a, p in enumerate(parents):
        depth_of.append(0 if p < 0 else depth_of[p] + 1)
        lineage.append(([] if p < 0 else lineage[p]) + [a])
    q_tree = torch.randn(len(parents), heads, head_dim, generator=g).to(dtype)
    tree_path = torch.zeros(len(parents), 4, dtype=torch.long)
    for a, line in enumerate(lineage):
        tree_path[a, :len(line)] = torch.tensor(line) + ctx
    return (k_cache, v_cache, tables, q_tree, tree_path, torch.tensor([ctx + d for d in depth_of]), ctx, path,
            [[slot(0, p) for p in range(ctx)] + [slot(0, ctx + n) for n in line] for line in lineage])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_tree_rows_see_the_context_and_their_ancestors_and_equal_the_chain_bitwise(dtype, tol):
    """A tree row attends to the context and its own ancestors only (against a float64 reference),
    and a row on the accepted path gets the bits of the same tokens laid out as a chain."""
    k_cache, v_cache, tables, q_tree, tree_path, pos, ctx, path, keys = _tree_case(dtype)
    n = len(pos)
    dev = lambda x: x.to(DEVICE)  # noqa: E731
    tree = triton_kernel.paged_attention_triton(
        dev(q_tree), dev(k_cache), dev(v_cache), dev(torch.zeros(n, dtype=torch.long)), dev(pos), dev(tables), 0.125,
        tree_base=dev(torch.full((n,), ctx)), tree_path=dev(tree_path)).cpu()
    k_flat, v_flat = k_cache.view(-1, *k_cache.shape[2:]).double(), v_cache.view(-1, *v_cache.shape[2:]).double()
    for t, slots in enumerate(keys):  # reference: softmax over exactly the keys this row may see
        kk, vv = k_flat[slots].repeat_interleave(2, 1), v_flat[slots].repeat_interleave(2, 1)  # GQA 4/2
        w = torch.einsum("hd,khd->hk", q_tree[t].double(), kk).mul(0.125).softmax(-1)
        torch.testing.assert_close(tree[t].double(), torch.einsum("hk,khd->hd", w, vv), atol=tol, rtol=tol)
    chain = triton_kernel.paged_attention_triton(
        dev(q_tree[path]), dev(k_cache), dev(v_cache), dev(torch.ones(len(path), dtype=torch.long)),
        dev(torch.arange(ctx, ctx + len(path))), dev(tables), 0.125).cpu()
    assert torch.equal(tree[path], chain)
