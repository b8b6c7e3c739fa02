"""kernels/cpu_quant_amx.cpp: Q4_K and Q6_K on AMX-INT8 tiles, the path for every row count where
the CPU has AMX-INT8. Its bits are its own (one float accumulator per output, not the lane paths'
eight), so what is checked: a row's bits alone and inside any block of rows, at 1 and 2 threads;
closeness to a float64 reference from the dequantized weight and x quantized as the kernels do it;
closeness to the lane path (SPECD_CPU_AMX=0, in a subprocess), whose bits it must not be (else this
tested the other path). Skipped where the CPU lacks AMX-INT8 or the build is not AVX-512.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("gguf")
from specd.kernels import cpu_ops  # noqa: E402
from test_cpu_quant_matmul import Q, blocks, packed_from  # noqa: E402

pytestmark = pytest.mark.skipif(
    not cpu_ops.available() or cpu_ops.isa() != "avx512" or not {"amx_tile", "amx_int8"} <= cpu_ops.cpu_flags()
    or os.environ.get("SPECD_CPU_AMX") == "0",
    reason="needs the avx512 build on a CPU with AMX-INT8 (and SPECD_CPU_AMX not 0)")
KQUANTS = [Q.Q4_K, Q.Q6_K]
# Per row, |y - reference| / |reference|: the integer sums are exact, what is left is float32 rounding
# of the block steps (measured 1e-7 .. 2e-7); a wrong scale, min, nibble or sub-block is off by far more.
TOLERANCE = 1e-5


def quantized_x(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels quantize it for the k-quants (quantize_rows, groups of 256): per group
    d = max|x| / 127, q = round-half-even(x * (1 / d)), in float64 as q x d."""
    m, k = x.shape
    xf = x.float().reshape(m, k // 256, 256)
    d = xf.abs().amax(-1) / 127
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xf * inv[..., None])
    return (q.double() * d.double()[..., None]).reshape(m, k)


def inputs(tmp_path, qtype, rows=21, k=4608, m=40):
    """rows = 21: a column block of 16 and one of 5 (masked lanes); K = 4608: 18 blocks."""
    p = packed_from(tmp_path, [(qtype, blocks(qtype, rows, k, seed=int(qtype)))])
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4).bfloat16()
    x[7, :300] = 0  # an all-zero group of x (scale 0)
    x[11] = 0  # an all-zero row
    return p, x


def row_errors(y: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (y.double() - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-30)


@pytest.mark.parametrize("qtype", KQUANTS, ids=lambda q: q.name)
def test_a_rows_bits_are_the_same_alone_and_in_any_block(tmp_path, qtype):
    p, x = inputs(tmp_path, qtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([torch.ops.specd_cpu.quant_linear(x[r:r + 1], p, None, True) for r in range(len(x))])
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in (2, 3, 5, 9, 16, 17, 40):
                for start in {0, len(x) - m, 3 if m + 3 <= len(x) else 0}:
                    y = torch.ops.specd_cpu.quant_linear(x[start:start + m], p, None, True)
                    assert torch.equal(y, alone[start:start + m]), (threads, start, m)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("qtype", KQUANTS, ids=lambda q: q.name)
@pytest.mark.parametrize("k", [256, 4608])
def test_matmul_matches_the_float64_reference(tmp_path, qtype, k):
    p, x = inputs(tmp_path, qtype, k=k)
    w = torch.ops.specd_cpu.quant_dequantize_rows(p, torch.arange(21)).double()
    ref = quantized_x(x) @ w.T
    bias = torch.randn(21, generator=torch.Generator().manual_seed(3))
    y = torch.ops.specd_cpu.quant_linear(x, p, bias, True)
    nonzero = ref.norm(dim=1) > 0
    assert row_errors(y - bias, ref)[nonzero].max().item() < TOLERANCE
    assert torch.equal(y[11], bias)  # an all-zero row: the bias alone
    y16 = torch.ops.specd_cpu.quant_linear(x, p, bias)
    assert torch.equal(y16, y.bfloat16())


def test_fused_parts_equal_each_part_alone(tmp_path):
    """A fused projection: Q4_K and Q6_K parts (this path) beside Q5_K and Q8_0 ones (the lane
    paths), 21 + 35 + 3 + 16 rows, so parts cross the 16-column chunks."""
    parts = [(Q.Q4_K, blocks(Q.Q4_K, 21, 512)), (Q.Q6_K, blocks(Q.Q6_K, 35, 512)),
             (Q.Q5_K, blocks(Q.Q5_K, 3, 512)), (Q.Q8_0, blocks(Q.Q8_0, 16, 512))]
    fused = packed_from(tmp_path, parts)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(4)).bfloat16()
    alone = []
    for i, part in enumerate(parts):
        (tmp_path / str(i)).mkdir()
        alone.append(torch.ops.specd_cpu.quant_linear(x, packed_from(tmp_path / str(i), [part]), None, True))
    assert torch.equal(torch.ops.specd_cpu.quant_linear(x, fused, None, True), torch.cat(alone, dim=1))
    for m in (1, 2, 5):
        assert torch.equal(torch.ops.specd_cpu.quant_linear(x[:m], fused, None, True), torch.cat(alone, dim=1)[:m])


_LANE_SCRIPT = """
import sys, torch
from specd.kernels import cpu_ops
assert cpu_ops.available()
torch.save([torch.ops.specd_cpu.quant_linear(x, q, None, True) for q, x in torch.load(sys.argv[1])], sys.argv[2])
"""


def test_close_to_the_lane_path_and_not_its_bits(tmp_path):
    cases = []
    for qtype in KQUANTS:
        for k in (256, 4608):
            (tmp_path / f"{qtype.name}{k}").mkdir()
            p, x = inputs(tmp_path / f"{qtype.name}{k}", qtype, k=k, m=17)
            cases.append((p, x))
    torch.save(cases, tmp_path / "in.pt")
    script = tmp_path / "run.py"
    script.write_text(_LANE_SCRIPT)
    env = {**os.environ, "SPECD_CPU_AMX": "0", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(script), str(tmp_path / "in.pt"), str(tmp_path / "out.pt")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    for (p, x), lanes in zip(cases, torch.load(tmp_path / "out.pt")):
        ours = torch.ops.specd_cpu.quant_linear(x, p, None, True)
        nonzero = lanes.double().norm(dim=1) > 0
        assert row_errors(ours, lanes.double())[nonzero].max().item() < TOLERANCE
        assert not torch.equal(ours, lanes)  # this path ran, not the lane path
