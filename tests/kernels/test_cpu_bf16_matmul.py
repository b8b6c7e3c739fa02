"""kernels/cpu_bf16_matmul.cpp: the engine's bf16 CPU matmul. Right to bf16 rounding against float64, and
batch-invariant by construction: a row's bits do not depend on how many rows are computed with it, where it
sits among them, or the thread count, on every instruction path the CPU has (AMX tiles, AVX512-BF16's
vdpbf16ps, float32 FMAs)."""
import ast
import os
import subprocess
import sys

import pytest
import torch

from matmul_paths import expected_path
from specd.kernels import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.cpu_supported(), reason="the fused CPU ops need x86-64 Linux with AVX-512 or AVX2 + FMA")
ops = torch.ops.specd_cpu
# The default target's shapes (qkv, o, gate_up, down, head) and odd ones (tails of K and N).
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 4099), (37, 21), (1, 5)]


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_ops.available(), "the CPU ops did not build on a CPU that supports them"


def weights(K: int, N: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).bfloat16()
    return w, torch.randn(N, generator=g).bfloat16(), torch.randn(70, K, generator=g).bfloat16()


@pytest.mark.parametrize("K,N", SHAPES)
def test_matches_float64_to_bf16_rounding(K, N):
    w, b, x = weights(K, N)
    ref = x.double() @ w.double().T + b.double()
    y = ops.linear(x, ops.pack_linear_weight(w), b.float(), N)
    assert y.dtype == torch.bfloat16 and y.shape == (70, N)
    # float32 accumulation, then one bf16 rounding: within 2^-8 relative of the largest term's scale
    scale = (x.double().abs() @ w.double().abs().T + b.double().abs())
    assert ((y.double() - ref).abs() <= scale * 2 ** -7).all()
    y32 = ops.linear(x, ops.pack_linear_weight(w), b.float(), N, True)
    assert y32.dtype == torch.float32 and torch.equal(y32.bfloat16(), y)  # the same sums, unrounded


@pytest.mark.parametrize("K,N", SHAPES)
def test_a_row_has_the_same_bits_in_any_block(K, N):
    w, b, x = weights(K, N, seed=1)
    packed = ops.pack_linear_weight(w)
    alone = torch.cat([ops.linear(x[i:i + 1], packed, b, N) for i in range(len(x))])
    for m in (2, 3, 4, 5, 6, 7, 9, 13, 17, 31, 48, 49, 70):
        for start in (0, len(x) - m):
            assert torch.equal(ops.linear(x[start:start + m], packed, b, N), alone[start:start + m]), (m, start)


def test_thread_count_does_not_change_the_bits():
    w, b, x = weights(1536, 576, seed=2)
    packed = ops.pack_linear_weight(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.linear(x, packed, b, 576)
        torch.set_num_threads(max(2, os.cpu_count() or 2))
        assert torch.equal(ops.linear(x, packed, b, 576), one)
    finally:
        torch.set_num_threads(threads)


def test_bad_shapes_are_refused():
    w, b, x = weights(64, 32)
    packed = ops.pack_linear_weight(w)
    with pytest.raises(RuntimeError, match="does not match the packed weight"):
        ops.linear(x[:, :62], packed, None, 32)
    with pytest.raises(RuntimeError, match="bias must have out_features"):
        ops.linear(x, packed, b[:31], 32)


def test_the_path_taken_is_the_widest_the_cpu_has():
    for K, _ in SHAPES:
        assert ops.bf16_matmul_path(K) == expected_path(K), K


def test_the_dot_product_is_measured_against_fmas_where_the_cpu_has_it():
    """Unswitched, a CPU with AVX512-BF16 times its vdpbf16ps against two float32 FMAs once
    (the instruction is the slower one on some CPUs); elsewhere nothing is measured."""
    probe = list(ops.bf16_dot_probe())
    measures = (cpu_ops.isa() == "avx512" and "avx512_bf16" in cpu_ops.cpu_flags()
                and os.environ.get("SPECD_CPU_BF16_DOT") not in ("0", "1"))
    assert len(probe) == (2 if measures else 0), probe
    assert all(0 < t < 1 for t in probe), probe  # seconds of a few-millisecond measurement


@pytest.mark.parametrize("switch", [("SPECD_CPU_BF16_DOT", "0"), ("SPECD_CPU_BF16_DOT", "1"), ("SPECD_CPU_AMX", "0")])
def test_the_other_paths_are_invariant_too(switch):
    """SPECD_CPU_BF16_DOT=0: the path of AVX-512 CPUs without AVX512-BF16 (float32 FMAs); =1:
    vdpbf16ps without measuring it; SPECD_CPU_AMX=0: that of AVX512-BF16 CPUs without AMX. Each in
    a fresh process."""
    name, value = switch
    code = ("import torch; from specd.kernels import cpu_ops; assert cpu_ops.available(); "
            "import tests.kernels.test_cpu_bf16_matmul as t; "
            "[f(*s) for s in t.SHAPES for f in (t.test_matches_float64_to_bf16_rounding, "
            "t.test_a_row_has_the_same_bits_in_any_block)]; "
            "print(','.join(torch.ops.specd_cpu.bf16_matmul_path(K) for K, _ in t.SHAPES)); "
            "print(list(torch.ops.specd_cpu.bf16_dot_probe()))")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, name: value}
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600,
                         env={**env, "OMP_NUM_THREADS": "2",  # (tests/ for matmul_paths)
                              "PYTHONPATH": os.pathsep.join([os.path.join(root, "tests"), os.environ.get("PYTHONPATH", "")])})
    assert out.returncode == 0, out.stderr[-2000:]
    paths, probe = out.stdout.strip().splitlines()
    assert paths == ",".join(expected_path(K, env, ast.literal_eval(probe) or None) for K, _ in SHAPES)


def test_onednn_between_calls_does_not_disturb_the_tiles():
    """AMX tile configuration is per thread, and oneDNN's bf16 matmul (AMX on such CPUs) loads and
    releases its own on the same threads: calls interleaved with it give the same bits."""
    w, b, x = weights(576, 960, seed=3)
    packed = ops.pack_linear_weight(w)
    alone = [ops.linear(x[:m], packed, b, 960) for m in (1, 5, 40)]
    for _ in range(3):
        for m, want in zip((1, 5, 40), alone):
            torch.nn.functional.linear(x[:m], w, b)  # oneDNN
            assert torch.equal(ops.linear(x[:m], packed, b, 960), want), m
