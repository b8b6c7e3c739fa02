"""kernels/cpu_bf16_ops.cpp against torch: the same math, and batch invariance by construction."""
import math

import pytest
import torch
import torch.nn.functional as F

from specd.engine.model.rotary import apply_rotary
from specd.kernels import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.cpu_supported(), reason="the fused CPU ops need x86-64 Linux with AVX-512 or AVX2 + FMA")
ops = torch.ops.specd_cpu


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_ops.available(), "kernels/cpu_bf16_ops.cpp did not build on a CPU that supports it"


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of the bf16 spacing at b's magnitude."""
    spacing = torch.exp2(torch.floor(torch.log2(b.float().abs().clamp_min(1e-30))) - 7)
    return ((a.float() - b.float()).abs() / spacing).max().item()


def torch_rms_norm(x, w, eps):  # the engine's torch path (transformers' LlamaRMSNorm)
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def test_rms_norm_and_residual_add_match_torch():
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(37, 576, generator=g).bfloat16() * 3 for _ in range(2))
    w = (1 + 0.1 * torch.randn(576, generator=g)).bfloat16()
    assert bf16_ulps(ops.rms_norm(x, w, 1e-5), torch_rms_norm(x, w, 1e-5)) <= 1
    h, y = ops.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(h, x + r)
    assert bf16_ulps(y, torch_rms_norm(x + r, w, 1e-5)) <= 1


def test_silu_mul_matches_torch():
    gate_up = (torch.randn(9, 2 * 1536, generator=torch.Generator().manual_seed(1)) * 4).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    assert bf16_ulps(ops.silu_mul(gate_up), F.silu(gate) * up) <= 1


def test_rotary_and_kv_write_match_torch():
    g = torch.Generator().manual_seed(2)
    T, H, hkv, D, bs = 6, 9, 3, 64, 4
    qkv = torch.randn(T, H + 2 * hkv, D, generator=g).bfloat16()
    emb = torch.randn(T, 1, D, generator=g)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    k_cache, v_cache = torch.zeros(5, bs, hkv, D).bfloat16(), torch.zeros(5, bs, hkv, D).bfloat16()
    slots = torch.tensor([17, 3, 4, 5, 12, 0])
    q = ops.rotary_write_kv(qkv, H, cos, sin, k_cache, v_cache, slots)
    ref = apply_rotary(qkv[:, : H + hkv], cos, sin)
    assert torch.equal(q, ref[:, :H])  # the same roundings as torch's bf16 ops, so the same bits
    assert torch.equal(k_cache.view(-1, hkv, D)[slots], ref[:, H:])
    assert torch.equal(v_cache.view(-1, hkv, D)[slots], qkv[:, H + hkv:])
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache.view(-1, hkv, D)[untouched].any()
    with pytest.raises(RuntimeError, match="out of range"):
        ops.rotary_write_kv(qkv, H, cos, sin, k_cache, v_cache, torch.tensor([20, 0, 1, 2, 3, 4]))


def paged_setup(seed=3, blocks=12, bs=4, hkv=2, D=64):
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(blocks, bs, hkv, D, generator=g).bfloat16()
    v_cache = torch.randn(blocks, bs, hkv, D, generator=g).bfloat16()
    return g, k_cache, v_cache


def reference_attention(q, keys, values, scale):  # float64, one row: q [H, D], keys [C, Hkv, D]
    group = q.shape[0] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)  # [C, H, D]
    s = torch.einsum("hd,chd->hc", q.double(), k) * scale
    return torch.einsum("hc,chd->hd", s.softmax(-1), values.double().repeat_interleave(group, dim=1))


@pytest.mark.parametrize("D", [64, 128, 40])  # the register paths and the generic loop
def test_paged_attention_matches_reference_and_is_row_invariant(D):
    g, k_cache, v_cache = paged_setup(D=D)
    H, bs = 6, 4
    tables = torch.tensor([[7, 2, 9, 0, 5], [1, 3, 4, 6, 8]])  # two sequences, scattered blocks
    q = torch.randn(5, H, D, generator=g).bfloat16()
    seq = torch.tensor([0, 0, 0, 1, 1])  # a 3-token verify block and a 2-token one
    pos = torch.tensor([16, 17, 18, 9, 10])
    out = ops.paged_attention(q, k_cache, v_cache, tables, seq, pos, None, D ** -0.5, 0)
    flat_k, flat_v = k_cache.view(-1, 2, D), v_cache.view(-1, 2, D)
    for t in range(5):
        keys = torch.arange(pos[t] + 1)
        rows = tables[seq[t], keys // bs] * bs + keys % bs
        ref = reference_attention(q[t].float(), flat_k[rows], flat_v[rows], D ** -0.5)
        assert (out[t].double() - ref).abs().max() < 2e-2
        # the same token alone, as a plain decode step would compute it: the same bits
        alone = ops.paged_attention(q[t:t + 1], k_cache, v_cache, tables[seq[t]:seq[t] + 1], torch.tensor([0]),
                                    pos[t:t + 1], None, D ** -0.5, 0)
        assert torch.equal(alone, out[t:t + 1])


@pytest.mark.parametrize("D", [64, 128])
def test_verify_blocks_read_shared_keys_with_each_tokens_own_bits(D):
    """Rows of a sequence's verify block share each key load (tiles of up to 12 rows of a KV head, split
    by the thread count): each token's output must still be the bits of that token decoded alone,
    whatever the tiling, and near the float64 reference over hundreds of keys."""
    g, k_cache, v_cache = paged_setup(seed=5, blocks=48, bs=16, hkv=3, D=D)
    H = 9  # 3 query heads per KV head, as the default target: a 9-token block is 27 rows per KV head
    tables = torch.randperm(48, generator=g)[:45].view(3, 15)
    seq = torch.tensor([0] * 9 + [1] + [2] * 5)  # a 9-token block, a decode token, a 5-token block
    pos = torch.tensor(list(range(200, 209)) + [40] + list(range(60, 65)))
    q = (torch.randn(len(seq), H, D, generator=g) * 3).bfloat16()
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(ops.paged_attention(q, k_cache, v_cache, tables, seq, pos, None, D ** -0.5, 0))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    flat_k, flat_v = k_cache.view(-1, 3, D), v_cache.view(-1, 3, D)
    for t in range(len(seq)):
        alone = ops.paged_attention(q[t:t + 1], k_cache, v_cache, tables[seq[t]:seq[t] + 1], torch.tensor([0]),
                                    pos[t:t + 1], None, D ** -0.5, 0)
        assert torch.equal(alone, outs[0][t:t + 1]), t
        keys = torch.arange(pos[t] + 1)
        rows = tables[seq[t], keys // 16] * 16 + keys % 16
        ref = reference_attention(q[t].float(), flat_k[rows], flat_v[rows], D ** -0.5)
        assert (outs[0][t].double() - ref).abs().max() < 2e-2


def test_sliding_window_and_tree_rows():
    g, k_cache, v_cache = paged_setup(seed=4)
    D, bs = 64, 4
    q = torch.randn(1, 4, D, generator=g).bfloat16()
    table = torch.tensor([[3, 1, 0, 2]])
    windowed = ops.paged_attention(q, k_cache, v_cache, table, torch.tensor([0]), torch.tensor([13]), None, 0.125, 5)
    keys = torch.arange(9, 14)
    rows = table[0, keys // bs] * bs + keys % bs
    ref = reference_attention(q[0].float(), k_cache.view(-1, 2, D)[rows], v_cache.view(-1, 2, D)[rows], 0.125)
    assert (windowed[0].double() - ref).abs().max() < 2e-2
    # A tree row at depth 2 whose ancestors sit at key indices 12 and 15 (siblings in between) sees
    # context 0..10, then 12, then 15: the bits of a chain whose keys are laid out that way.
    key_index = torch.tensor([list(range(11)) + [12, 15] + [0] * 3])
    tree = ops.paged_attention(q, k_cache, v_cache, table, torch.tensor([0]), torch.tensor([12]), key_index, 0.125, 0)
    order = torch.tensor(list(range(11)) + [12, 15])
    rows = table[0, order // bs] * bs + order % bs
    chain_k = k_cache.view(-1, 2, D)[rows].view(13, 1, 2, D)
    chain_v = v_cache.view(-1, 2, D)[rows].view(13, 1, 2, D)
    chain = ops.paged_attention(q, chain_k, chain_v, torch.arange(13).view(1, 13), torch.tensor([0]),
                                torch.tensor([12]), None, 0.125, 0)
    assert torch.equal(tree, chain)


def test_bad_input_is_refused():
    _, k_cache, v_cache = paged_setup()
    q = torch.zeros(1, 4, 64).bfloat16()
    with pytest.raises(RuntimeError, match="out of range"):
        ops.paged_attention(q, k_cache, v_cache, torch.tensor([[0, 1]]), torch.tensor([0]), torch.tensor([8]),
                            None, 0.125, 0)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.rms_norm(torch.zeros(2, 8), torch.ones(8), 1e-5)
    assert math.isfinite(ops.silu_mul(torch.full((1, 4), -200.0).bfloat16()).float().sum().item())
