"""Builds and loads kernels/cpu_bf16_ops.cpp: fused bfloat16 ops for CPU decode (torch.ops.specd_cpu).

Compiled once per machine with the C++ compiler torch's extension loader finds, into
$SPECD_CACHE/torch_extensions; later loads take a second. Where that fails (no compiler, no
ninja, not Linux on x86-64 with AVX-512) `available()` is False and the engine keeps its torch
path, logging why once. SPECD_CPU_KERNELS=0 turns the ops off.
"""
from __future__ import annotations

import functools
import logging
import os
import platform
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCES = [Path(__file__).with_name(name) for name in ("cpu_bf16_ops.cpp", "cpu_bf16_matmul.cpp")]
REQUIRED_FLAGS = {"avx512f", "avx512bw", "avx512vl"}  # what the -m flags below let the compiler use


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _build() -> None:
    from torch.utils.cpp_extension import load

    from specd.cache import cache_root

    build_dir = cache_root() / "torch_extensions" / f"torch{torch.__version__}"
    build_dir.mkdir(parents=True, exist_ok=True)
    # The ops are plain C++ the compiler vectorises; AVX-512 widens its vectors to 16 floats.
    load(name="specd_cpu_bf16_ops", sources=[str(s) for s in SOURCES], build_directory=str(build_dir),
         extra_cflags=["-O3", "-fopenmp"] + [f"-m{flag}" for flag in sorted(REQUIRED_FLAGS)], extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)


def cpu_supported() -> bool:
    return (platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")
            and REQUIRED_FLAGS <= cpu_flags())


@functools.cache
def available() -> bool:
    """Whether torch.ops.specd_cpu is loaded (building it on first use)."""
    why = None
    if os.environ.get("SPECD_CPU_KERNELS", "1") == "0":
        why = "SPECD_CPU_KERNELS=0"
    elif not cpu_supported():
        why = f"built for Linux x86-64 with AVX-512 only (this is {platform.system()} {platform.machine()})"
    else:
        try:
            _build()
        except Exception as e:  # a missing compiler or ninja surfaces as various errors
            why = f"building {SOURCES[0].name} failed: {str(e).splitlines()[-1] if str(e) else type(e).__name__}"
    if why:
        log.warning("fused bfloat16 CPU ops off (%s); decode uses the slower torch path", why)
    return why is None
