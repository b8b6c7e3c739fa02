"""kernels/cpu_quant_matmul.cpp: matmuls on GGUF's packed blocks, against the gguf package.

Blocks of the legacy types are made by the gguf package's own quantizer; the k-quants (which it
reads but does not write) are random bytes with fp16 scales of a sane size, which exercises every
bit of their layouts. The reference is the gguf package's dequantization, times x in float32.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from specd.engine.model.quant import KERNEL_TYPES, QuantPart, pack  # noqa: E402
from specd.kernels import cpu_ops  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the fused CPU ops did not build here")
TYPES = [Q(t) for t in KERNEL_TYPES]
# x is quantized to 8 bits per 32 values, as llama.cpp does: each product's error is at most half a
# step of x's block (|x|max / 254), so a dot product's error stays well under 1% of the largest output
# on these random inputs (measured 0.5-0.6%); a wrong scale, nibble or permutation is off by ~100%.
TOLERANCE = 0.02


def blocks(qtype: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    block, size = KERNEL_TYPES[int(qtype)]
    if block == 32:
        return gguf.quants.quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), qtype)
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.001).tobytes(), dtype=np.uint8)
    if qtype == Q.Q6_K:
        raw[..., 208:210] = scale
    else:
        raw[..., 0:2] = scale
        raw[..., 2:4] = np.frombuffer(np.float16(0.0005).tobytes(), dtype=np.uint8)
    return raw.reshape(rows, -1)


def packed_from(tmp_path, parts: list[tuple[Q, np.ndarray]]) -> torch.Tensor:
    """parts written one after another to a file, then packed from it as the loader does."""
    path = tmp_path / "w.bin"
    qparts, offset = [], 0
    with open(path, "wb") as f:
        for i, (qtype, raw) in enumerate(parts):
            f.write(raw.tobytes())
            block, _ = KERNEL_TYPES[int(qtype)]
            qparts.append(QuantPart(f"t{i}", int(qtype), raw.shape[0], raw.shape[1] // KERNEL_TYPES[int(qtype)][1] * block,
                                    str(path), offset))
            offset += raw.nbytes
    return pack(qparts)


def reference(parts: list[tuple[Q, np.ndarray]]) -> torch.Tensor:
    return torch.cat([torch.from_numpy(gguf.quants.dequantize(raw, q).reshape(raw.shape[0], -1)) for q, raw in parts])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_dequantized_rows_are_the_gguf_packages_values(tmp_path, qtype):
    parts = [(qtype, blocks(qtype, 24, 512))]
    p = packed_from(tmp_path, parts)
    ids = torch.tensor([5, 0, 23, 5])
    assert torch.equal(torch.ops.specd_cpu.quant_dequantize_rows(p, ids), reference(parts)[ids])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_matmul_matches_the_dequantized_weight(tmp_path, qtype):
    parts = [(qtype, blocks(qtype, 40, 512))]
    p = packed_from(tmp_path, parts)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(1)).bfloat16()
    bias = torch.randn(40, generator=torch.Generator().manual_seed(2))
    ref = x.float() @ reference(parts).T + bias
    y = torch.ops.specd_cpu.quant_linear(x, p, bias, True)
    assert ((y - ref).abs().max() / ref.abs().max()).item() < TOLERANCE
    y16 = torch.ops.specd_cpu.quant_linear(x, p, bias)  # bfloat16 out: the float result rounded
    assert y16.dtype == torch.bfloat16 and torch.equal(y16, y.bfloat16())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_a_rows_bits_are_the_same_alone_and_in_any_block(tmp_path, qtype):
    """Blocks of 5-16 rows (a verify block) and more (prefill) take the many-row kernels on AVX-512,
    2-4 rows the 1-4 row kernels; the AVX2 build takes up to 9 rows a pass (35: 9, 9, 9, 8): a row's bits
    there are its bits alone, which the 1-row kernel computes as before (and the portable path,
    test_the_portable_path_gives_the_simd_paths_bits). K = 4608: the many-row kernels take a weight row
    in spans of K (3 at 16 rows, 2 at 9); 17 and 35 rows: groups of 16 and the rest."""
    k = 4608
    p = packed_from(tmp_path, [(qtype, blocks(qtype, 21, k))])
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(35, k, generator=g) * torch.rand(35, 1, generator=g) * 4).bfloat16()
    x[7, :300] = 0  # an all-zero group of x (scale 0)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([torch.ops.specd_cpu.quant_linear(x[r:r + 1], p, None, True) for r in range(len(x))])
        torch.set_num_threads(2)
        for start, m in [(0, 2), (0, 3), (1, 5), (0, 8), (2, 9), (0, 16), (3, 17), (0, 35)]:
            assert torch.equal(torch.ops.specd_cpu.quant_linear(x[start:start + m], p, None, True),
                               alone[start:start + m]), (start, m)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_bits_do_not_depend_on_the_row_count_or_threads(tmp_path, threads):
    parts = [(Q.Q5_0, blocks(Q.Q5_0, 30, 256)), (Q.Q4_K, blocks(Q.Q4_K, 20, 256)), (Q.Q6_K, blocks(Q.Q6_K, 17, 256))]
    p = packed_from(tmp_path, parts)
    x = torch.randn(37, 256, generator=torch.Generator().manual_seed(3)).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        full = torch.ops.specd_cpu.quant_linear(x, p, None, True)
        torch.set_num_threads(threads)
        for start, m in [(0, 1), (0, 2), (0, 5), (11, 1), (3, 7), (0, 37)]:
            assert torch.equal(torch.ops.specd_cpu.quant_linear(x[start:start + m], p, None, True),
                               full[start:start + m]), (start, m)
    finally:
        torch.set_num_threads(before)


def test_wide_weights_in_mixed_parts_match_the_dequantized_weight(tmp_path):
    # 660 columns: a thread's share runs in several spans of 256, parts crossing their edges
    parts = [(Q.Q8_0, blocks(Q.Q8_0, 300, 256)), (Q.Q4_K, blocks(Q.Q4_K, 243, 256)), (Q.Q6_K, blocks(Q.Q6_K, 117, 256))]
    p = packed_from(tmp_path, parts)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(5)).bfloat16()
    ref = x.float() @ reference(parts).T
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            y = torch.ops.specd_cpu.quant_linear(x, p, None, True)
            assert ((y - ref).abs().amax(dim=0) / ref.abs().max()).max().item() < TOLERANCE, threads
    finally:
        torch.set_num_threads(before)


def test_parts_of_mixed_types_equal_each_part_alone(tmp_path):
    parts = [(Q.Q8_0, blocks(Q.Q8_0, 8, 256)), (Q.Q4_1, blocks(Q.Q4_1, 5, 256)), (Q.Q5_K, blocks(Q.Q5_K, 3, 256))]
    fused = packed_from(tmp_path, parts)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    alone = [torch.ops.specd_cpu.quant_linear(x, packed_from(tmp_path, [part]), None, True) for part in parts]
    assert torch.equal(torch.ops.specd_cpu.quant_linear(x, fused, None, True), torch.cat(alone, dim=1))


def test_the_row_order_of_a_part_is_applied(tmp_path):
    raw = blocks(Q.Q8_0, 6, 64)
    path = tmp_path / "w.bin"
    path.write_bytes(raw.tobytes())
    part = QuantPart("t", int(Q.Q8_0), 6, 64, str(path), 0)
    part.row_order = np.array([3, 1, 0, 5, 4, 2])
    p = pack([part])
    assert torch.equal(torch.ops.specd_cpu.quant_dequantize_rows(p, torch.arange(6)),
                       reference([(Q.Q8_0, raw)])[torch.from_numpy(part.row_order)])


def test_bad_inputs_are_refused_with_a_message(tmp_path):
    p = packed_from(tmp_path, [(Q.Q8_0, blocks(Q.Q8_0, 4, 64))])
    with pytest.raises(RuntimeError, match="does not match the weight's K"):
        torch.ops.specd_cpu.quant_linear(torch.zeros(1, 32).bfloat16(), p, None)
    with pytest.raises(RuntimeError, match="bad header"):
        torch.ops.specd_cpu.quant_linear(torch.zeros(1, 64).bfloat16(), torch.zeros(256, dtype=torch.uint8), None)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.specd_cpu.quant_dequantize_rows(p, torch.tensor([4]))


_PORTABLE_SCRIPT = """
import sys, torch
from specd.kernels import cpu_ops
assert cpu_ops.available()
torch.save([torch.ops.specd_cpu.quant_linear(x, q, None, True) for q, x in torch.load(sys.argv[1])], sys.argv[2])
"""


@pytest.mark.parametrize("other", ["SPECD_QUANT_PORTABLE", "SPECD_CPU_VNNI"])
def test_the_portable_path_gives_the_simd_paths_bits(tmp_path, other):
    """SPECD_QUANT_PORTABLE=1: the plain C++ that a CPU without AVX2 would run, bit for bit, against
    this build's AVX2 or AVX-512 path (11 rows: the AVX-512 build's many-row kernels); 544 = 17
    blocks of 32, an odd count (the AVX-512 1-4 row path takes blocks in pairs). SPECD_CPU_VNNI=0:
    the AVX-512 path without AVX512-VNNI's dot products, against this CPU's with them."""
    if cpu_ops.isa() is None:
        pytest.skip("no SIMD build here")
    if other == "SPECD_CPU_VNNI" and not (cpu_ops.isa() == "avx512" and "avx512_vnni" in cpu_ops.cpu_flags()):
        pytest.skip("needs the avx512 build on a CPU with AVX512-VNNI (elsewhere both runs take the same path)")
    cases = [(q, k) for q in TYPES for k in (512, 544) if k % KERNEL_TYPES[int(q)][0] == 0]
    packs = [packed_from(tmp_path / f"{q.name}-{k}", [(q, blocks(q, 19, k))]) for q, k in cases
             if (tmp_path / f"{q.name}-{k}").mkdir() is None]
    g = torch.Generator().manual_seed(5)
    xs = {k: torch.randn(11, k, generator=g).bfloat16() for k in (512, 544)}  # 11: pairs of rows and a lone one
    inputs = [(p, xs[k]) for p, (_, k) in zip(packs, cases)]
    torch.save(inputs, tmp_path / "in.pt")
    script = tmp_path / "run.py"
    script.write_text(_PORTABLE_SCRIPT)
    # Both sides in a process of their own with SPECD_CPU_AMX=0: on a CPU with AMX-INT8, Q4_K and Q6_K
    # otherwise take cpu_quant_amx.cpp, whose bits are its own (tests/kernels/test_cpu_quant_amx.py).
    outs = []
    for switch in ({}, {other: "1" if other == "SPECD_QUANT_PORTABLE" else "0"}):
        env = {**os.environ, **switch, "SPECD_CPU_AMX": "0", "OMP_NUM_THREADS": "1"}
        out = tmp_path / f"out{len(outs)}.pt"
        run = subprocess.run([sys.executable, str(script), str(tmp_path / "in.pt"), str(out)], env=env,
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        outs.append(torch.load(out))
    for (q, k), mine, theirs in zip(cases, *outs):
        assert torch.equal(mine, theirs), (q.name, k)
