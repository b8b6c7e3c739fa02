"""Which instructions kernels/cpu_bf16_matmul.cpp should take for a weight of K inputs on this CPU,
worked out from /proc/cpuinfo and the switches in `env` (its header: AMX tiles where the CPU has
them and K is a multiple of 32, else AVX512-BF16's vdpbf16ps, else float32 FMAs), as the tests'
independent account of what torch.ops.specd_cpu.bf16_matmul_path reports."""
from __future__ import annotations

import os

from specd.kernels import cpu_ops

NAMES = {"amx": "AMX tiles", "avx512_bf16": "AVX512-BF16 (vdpbf16ps)", "fma": "float32 FMAs"}  # the loader's log


def expected_path(K: int, env=os.environ) -> str:
    flags = cpu_ops.cpu_flags()
    dots = env.get("SPECD_CPU_BF16_DOT") != "0" and cpu_ops.isa() == "avx512"
    if dots and env.get("SPECD_CPU_AMX") != "0" and {"amx_tile", "amx_bf16"} <= flags and K % 32 == 0:
        return "amx"
    return "avx512_bf16" if dots and "avx512_bf16" in flags else "fma"
