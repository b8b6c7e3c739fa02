"""Which instructions kernels/cpu_bf16_matmul.cpp should take for a weight of K inputs on this CPU,
worked out from /proc/cpuinfo, the switches in `env` and the kernel's measurement of its two pair
products (its header: AMX tiles where the CPU has them and K is a multiple of 32, else AVX512-BF16's
vdpbf16ps unless float32 FMAs measured clearly faster, else float32 FMAs), as the tests' independent
account of what torch.ops.specd_cpu.bf16_matmul_path reports."""
from __future__ import annotations

import os

from specd.kernels import cpu_ops

NAMES = {"amx": "AMX tiles", "avx512_bf16": "AVX512-BF16 (vdpbf16ps)", "fma": "float32 FMAs"}  # the loader's log
FMA_MARGIN = 0.9  # FMAs are taken over vdpbf16ps only below this share of its time


def expected_path(K: int, env=os.environ, probe: list[float] | None = None) -> str:
    """probe: torch.ops.specd_cpu.bf16_dot_probe() of the process asked about (this one's by default)."""
    flags = cpu_ops.cpu_flags()
    switch = env.get("SPECD_CPU_BF16_DOT")
    dots = switch != "0" and cpu_ops.isa() == "avx512"
    if dots and env.get("SPECD_CPU_AMX") != "0" and {"amx_tile", "amx_bf16"} <= flags and K % 32 == 0:
        return "amx"
    if not (dots and "avx512_bf16" in flags):
        return "fma"
    if switch == "1":
        return "avx512_bf16"
    if probe is None:
        import torch

        probe = list(torch.ops.specd_cpu.bf16_dot_probe())
    dot, fma = probe
    return "fma" if fma < FMA_MARGIN * dot else "avx512_bf16"
