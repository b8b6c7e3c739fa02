"""The fused CPU ops built for AVX-512 and for AVX2 give the same bits (kernels/cpu_simd.h).

Each build runs in its own process (SPECD_CPU_ISA; tests/kernels/isa_outputs.py) on the same
inputs: bf16 matmuls of several shapes and the whole forward of two tiny models and of the
default target where it is fetched, greedy with drafts (the tiny models' bf16 activations round
away most one-ulp differences; on the default target, attention's sums taken in another order
changed 67 of its 72 logprobs, so that is where a difference shows). On an AVX-512 machine both
builds run natively (the matmul's bf16 dot product off, as it rounds its pairs differently, and the
AMX-INT8 path of Q4_K / Q6_K, whose bits are its own); on an AVX2 machine the AVX-512 code runs
through SIMDe's portable intrinsics where its headers are installed (Debian: libsimde-dev), so each
kind of machine checks the code path it would otherwise never run.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specd.models import model_store
from specd.kernels import cpu_ops

SCRIPT = Path(__file__).with_name("isa_outputs.py")


def _builds() -> list[str] | None:
    flags = cpu_ops.cpu_flags()
    if not set(cpu_ops.ISAS["avx2"]) <= flags:
        return None
    if set(cpu_ops.ISAS["avx512"]) <= flags:
        return ["avx512", "avx2"]
    return ["avx2", cpu_ops.EMULATED] if cpu_ops.simde_include() else None


@pytest.mark.timeout(1800)
def test_the_avx512_and_avx2_builds_give_the_same_bits(model_dirs, tmp_path):
    builds = _builds()
    if builds is None:
        pytest.skip("needs an AVX-512 CPU, or an AVX2 CPU with SIMDe's headers (libsimde-dev)")
    dirs = [model_dirs["qwen2"], model_dirs["qwen3"]]
    if model_store.is_fetched():
        dirs.append(str(model_store.target_dir()))
    outs = []
    for isa in builds:
        env = {**os.environ, "SPECD_CPU_ISA": isa, "SPECD_CPU_BF16_DOT": "0", "SPECD_CPU_AMX": "0",
               "OMP_NUM_THREADS": "1"}
        out = tmp_path / f"{isa}.pt"
        run = subprocess.run([sys.executable, str(SCRIPT), str(out), *dirs], env=env, capture_output=True,
                             text=True, timeout=1500)
        assert run.returncode == 0, run.stderr[-3000:]
        outs.append(torch.load(out))
    a, b = outs
    assert (a["isa"], b["isa"]) == tuple(builds)  # each process ran the build it was asked for
    for key in a:
        if key.startswith("linear"):
            assert torch.equal(a[key], b[key]), key
    for d in dirs:
        assert a[d] == b[d], d  # tokens and logprobs, bit for bit
