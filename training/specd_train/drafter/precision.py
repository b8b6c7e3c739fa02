"""Training precision: bfloat16 autocast only where the CPU multiplies bfloat16 natively.

With avx512_bf16 or AMX a bf16 matmul is several times faster than float32; without them
(an AVX2-only CPU) PyTorch falls back to a path ~100x slower than float32 (2048 x 576 x 8192:
52 s against 0.39 s, one thread, AMD EPYC with AVX2 only), so float32 is used there.
"""
from __future__ import annotations

import contextlib
import functools

import torch


@functools.lru_cache(maxsize=1)
def native_bf16() -> bool:
    try:
        flags = next(ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def label() -> str:
    """What a training run's forward ran in on this CPU (eval.json's train.precision, the cards' words)."""
    return "bf16 autocast" if native_bf16() else "float32 (no native bf16 matmul)"


def autocast():
    """The context a training forward runs in: bf16 autocast on CPUs that have it, else float32."""
    if native_bf16():
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()
