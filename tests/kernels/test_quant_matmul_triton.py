"""The weight-only int8/int4 Triton matmul: equals F.linear with the dequantized weight up to
rounding, gives each row the same bits whatever the number of rows computed with it, and
quantize_weight's round trip is off by at most half a step (TRITON_INTERPRET=1 on CPU)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

kernel = pytest.importorskip("specd.kernels.quant_matmul_triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # natively on a GPU, interpreted elsewhere
# one full BLOCK_K step and a partial one; one full BLOCK_N tile and a partial one
K, N = kernel.BLOCK_K + 64, kernel.BLOCK_N + 8


def quantized(n: int, k: int, bits: int, seed: int, scale_dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.1
    q, s, m = kernel.quantize_weight(w, bits, scale_dtype=scale_dtype)
    return w, q.to(DEVICE), s.to(DEVICE), None if m is None else m.to(DEVICE)


# Tolerances against float32 F.linear(x, dequantized weight): for float32 x the kernel's tile is
# the reference's weight to an ulp (scale * q + min, perhaps fused), so only the summation order
# differs: 1e-4 relative and absolute on outputs of size ~1. For bfloat16 x the tile is rounded to
# bfloat16 (2^-9 relative per weight) and so is the output: 2e-2, as test_matmul_invariant.py.
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("bits", [8, 4])
def test_matches_dequantized_linear(bits, bias, dtype, tol):
    _, q, s, m = quantized(N, K, bits, seed=bits)
    g = torch.Generator().manual_seed(10 + bits)
    x = torch.randn(19, K, generator=g).to(DEVICE, dtype)
    b = torch.randn(N, generator=g).to(DEVICE, dtype) if bias else None
    ref = F.linear(x.float(), kernel.dequantize_weight(q, s, m, bits), None if b is None else b.float())
    y = kernel.quant_matmul(x, q, s, m, bits=bits, bias=b)
    assert y.dtype == dtype and y.shape == (19, N)
    torch.testing.assert_close(y.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("bits", [8, 4])
def test_bf16_is_the_rounded_float32_sum(bits):
    """bf16 x: the tile is the dequantized weight rounded to bf16 (to nearest), each product is exact
    and the float32 sum is rounded to nearest once, so y is float32 F.linear on the bf16-rounded
    weight, rounded to bf16: equal but where the summation order tips a near-tie (rare), within an
    ulp there. (A truncating cast, as Triton 3.7's interpreter does by default, misses in about half.)"""
    _, q, s, m = quantized(N, K, bits, seed=11)
    x = torch.randn(19, K, generator=torch.Generator().manual_seed(12)).to(DEVICE, torch.bfloat16)
    ref = F.linear(x.float(), kernel.dequantize_weight(q, s, m, bits).to(torch.bfloat16).float())
    y = kernel.quant_matmul(x, q, s, m, bits=bits)
    assert (y != ref.to(torch.bfloat16)).float().mean() <= 0.01
    torch.testing.assert_close(y.float(), ref, rtol=2 ** -7, atol=1e-5)


@pytest.mark.parametrize("bits", [8, 4])
def test_float32_scales(bits):
    _, q, s, m = quantized(33, 64, bits, seed=3, scale_dtype=torch.float32)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    torch.testing.assert_close(kernel.quant_matmul(x, q, s, m, bits=bits), x @ kernel.dequantize_weight(q, s, m, bits).T,
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 4])
def test_rows_do_not_depend_on_the_row_count(bits, dtype):
    _, q, s, m = quantized(N, K, bits, seed=5)
    x = torch.randn(37, K, generator=torch.Generator().manual_seed(6)).to(DEVICE, dtype)
    full = kernel.quant_matmul(x, q, s, m, bits=bits)
    for n in (1, 2, 5, 16, 17):
        assert torch.equal(kernel.quant_matmul(x[:n], q, s, m, bits=bits), full[:n]), n
    for i in (20, 23):  # a row alone, from mid-batch (4th and 7th place in its 16-row tile there, 0th alone)
        assert torch.equal(kernel.quant_matmul(x[i:i + 1], q, s, m, bits=bits), full[i:i + 1]), i


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("bits", [8, 4])
def test_round_trip_is_within_half_a_step(bits, scale_dtype):
    g = torch.Generator().manual_seed(7)
    # rows of different magnitudes, a group of zeros and a constant group (both a zero step for 4 bits)
    w = torch.randn(24, 256, generator=g) * torch.logspace(-3, 1, 24)[:, None]
    w[3, 64:96], w[4, 0:32] = 0.0, 0.25
    q, s, m = kernel.quantize_weight(w, bits, scale_dtype=scale_dtype)
    assert q.shape == (24, 256 if bits == 8 else 128) and s.shape == (24, 8) and s.dtype == scale_dtype
    assert (m is None) == (bits == 8)
    err = (kernel.dequantize_weight(q, s, m, bits) - w).abs()
    step = s.float().repeat_interleave(32, dim=1)
    # half a step, and the rounding of the float32 arithmetic (and of a min stored in float16)
    slack = 1e-6 * w.abs() + (0 if m is None else m.float().abs().repeat_interleave(32, dim=1)
                              * (2 ** -11 if scale_dtype == torch.float16 else 2 ** -23))
    assert (err <= step / 2 * (1 + 1e-5) + slack).all(), (err - step / 2).max()
    assert err[3, 64:96].max() == 0 and (bits == 8 or err[4, 0:32].max() == 0)  # zero step: exact
    # and the bound is not slack: the error does reach close to half a step somewhere
    assert ((err / step.clamp_min(1e-30)) > 0.45).any()


def test_round_trip_uses_the_whole_range():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(8))
    q8, _, _ = kernel.quantize_weight(w, 8)
    assert q8.abs().amax(1).eq(127).all()  # each row's absmax group reaches +-127
    q4, _, _ = kernel.quantize_weight(w, 4)
    nib = torch.stack([q4 & 0xF, q4 >> 4], -1).reshape(8, 64).reshape(8, 2, 32)
    assert nib.amin(-1).eq(0).all() and nib.amax(-1).eq(15).all()  # each group spans 0..15


def test_nibble_order():
    """Low nibble = even k, high nibble = odd k; w = scale * q + min (GGUF's Q4_1 layout)."""
    q = torch.tensor([[0x21] * 16], dtype=torch.uint8)  # k even: 1, k odd: 2
    s, m = torch.tensor([[0.5]]), torch.tensor([[-1.0]])
    w = kernel.dequantize_weight(q, s, m, 4)
    assert w[0, :4].tolist() == [-0.5, 0.0, -0.5, 0.0]
    x = torch.zeros(1, 32)
    x[0, 1] = 1.0  # picks k = 1
    assert kernel.quant_matmul(x.to(DEVICE), q.to(DEVICE), s.to(DEVICE), m.to(DEVICE), bits=4).item() == 0.0
    x[0, 1], x[0, 2] = 0.0, 1.0  # picks k = 2
    assert kernel.quant_matmul(x.to(DEVICE), q.to(DEVICE), s.to(DEVICE), m.to(DEVICE), bits=4).item() == -0.5


@pytest.mark.parametrize("bits", [8, 4])
def test_k_not_a_multiple_of_32_raises(bits):
    with pytest.raises(ValueError, match=r"multiple of 32.*\(4, 48\)"):
        kernel.quantize_weight(torch.randn(4, 48), bits)
    q = torch.zeros(4, 48 if bits == 8 else 24, dtype=torch.int8 if bits == 8 else torch.uint8)
    s = torch.ones(4, 1)
    with pytest.raises(ValueError, match=r"multiple of 32.*\(2, 48\)"):
        kernel.quant_matmul(torch.randn(2, 48), q, s, s if bits == 4 else None, bits=bits)
    with pytest.raises(ValueError, match="multiple of 32"):
        kernel.dequantize_weight(q, s, s if bits == 4 else None, bits)


def test_a_gguf_files_q8_0_and_q4_parts_serve_through_it(tmp_path, monkeypatch):
    """A .gguf on a GPU (SPECD_FORCE_TRITON=1 stands in for one here, interpreted): Q8_0 parts become
    int8, Q4_0 and Q4_1 parts int4 for this kernel, the file's F16/BF16 parts dense; logits close to
    the same file dequantized to bfloat16, and greedy speculation gives plain decoding's tokens."""
    pytest.importorskip("gguf")
    from gguf_files import bpe_tokenizer, hf_model, prompt_logits, write_gguf
    from specd import LLM, SamplingParams
    from specd.engine.model.quant import GroupQuantLinear

    monkeypatch.setenv("SPECD_CACHE", str(tmp_path / "cache"))
    tokenizer = bpe_tokenizer("smollm")
    path = write_gguf(tmp_path / "tiny.gguf", "llama", hf_model("llama", tmp_path / "hf", len(tokenizer[0])), tokenizer)
    ids = [5, 17, 99, 250, 31, 8, 77, 5, 17]
    reference = LLM(str(path), dtype="bfloat16", device=DEVICE)
    monkeypatch.setenv("SPECD_FORCE_TRITON", "1")
    llm = LLM(str(path), device=DEVICE)
    model = llm.engine.model
    kinds = {p[0] for m in model.modules() if isinstance(m, GroupQuantLinear) for p in m.parts}
    assert kinds == {0, 4, 8}  # int8 (Q8_0), int4 (Q4_0, Q4_1), dense (F16, BF16 parts)
    assert model.quantization.startswith(("int8", "int4"))

    ours, ref = prompt_logits(llm, ids), prompt_logits(reference, ids)
    assert (ours - ref).abs().max().item() < 0.05 * (ref.max() - ref.min()).item()
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    plain = llm.generate([{"prompt_token_ids": ids}], sp)[0].token_ids
    # the file drafting for itself (in its own types too): every step drafts, rows of 1 to 4 tokens
    spec = LLM(str(path), device=DEVICE, speculative_config={"method": "draft_model", "model": str(path),
                                                             "num_speculative_tokens": 3, "adaptive": False})
    out = spec.generate([{"prompt_token_ids": ids}], sp)[0]
    assert out.token_ids == plain and out.spec["draft_tokens"] > 0
