"""Builds and loads kernels/cpu_bf16_ops.cpp: fused bfloat16 ops for CPU decode (torch.ops.specd_cpu;
paged attention in cpu_paged_attention.cpp), with the bf16 and GGUF-quantized matmuls
(cpu_bf16_matmul.cpp, cpu_quant_matmul.cpp and its AMX-INT8 path for the k-quants, cpu_quant_amx.cpp)
and the sampler's passes over float32 vocabulary rows (cpu_sampling_ops.cpp).

Compiled once per machine with the C++ compiler torch's extension loader finds, into
$SPECD_CACHE/torch_extensions/<torch version>-<ISA>, with a stamp of what it was built from
(sources, headers, flags, torch version): a library whose stamp matches loads as it is, with no
compiler, which is how the service images carry them (built in their cpu-ops stage). The ISA is the
widest the CPU offers: AVX-512 (f, bw, vl), else AVX2 with FMA (some hypervisors hide AVX-512 of
the CPUs under them); kernels/cpu_simd.h gives the ops the same per-element arithmetic on both.
Where that fails (no compiler, no ninja, not Linux on x86-64, neither ISA) `available()` is
False and the engine keeps its torch path, logging why once. SPECD_CPU_KERNELS=0 turns the ops off.
SPECD_CPU_ISA picks the build instead (tests/kernels/test_isa_builds.py compares them): avx512 or
avx2 where the CPU has it, or avx512-emulated: the AVX-512 code compiled for an AVX2 CPU through
SIMDe's portable intrinsics (its headers: SPECD_SIMDE_INCLUDE, else /usr/include; Debian's
libsimde-dev), slower, to check that code on a machine without AVX-512.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCES = [Path(__file__).with_name(name) for name in ("cpu_bf16_ops.cpp", "cpu_paged_attention.cpp", "cpu_bf16_matmul.cpp",
                                                       "cpu_quant_matmul.cpp", "cpu_quant_amx.cpp", "cpu_sampling_ops.cpp")]
# ISA -> the CPU flags its -m flags let the compiler use, widest first.
# fma: -mavx512f does not imply it for GCC, and the quantized kernel's AVX2 code (which the
# AVX-512 build runs) uses it; f16c: GGUF's fp16 scales.
ISAS = {"avx512": ("avx512f", "avx512bw", "avx512vl", "fma", "f16c"), "avx2": ("avx2", "fma", "f16c")}
STAMP = "specd-build.sha256"  # build_digest() of the library beside it
EMULATED = "avx512-emulated"  # a test build (module docstring): needs AVX2 + FMA and SIMDe's headers


def simde_include() -> Path | None:
    root = Path(os.environ.get("SPECD_SIMDE_INCLUDE", "/usr/include"))
    return root if (root / "simde" / "x86" / "avx512.h").is_file() else None


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def isa() -> str | None:
    """The instruction set the ops are built for on this CPU, or None where they cannot be."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    flags = cpu_flags()
    forced = os.environ.get("SPECD_CPU_ISA")
    if forced == EMULATED:
        return forced if set(ISAS["avx2"]) <= flags and simde_include() else None
    if forced:
        return forced if set(ISAS.get(forced, ("?",))) <= flags else None
    return next((name for name, needs in ISAS.items() if set(needs) <= flags), None)


def build_dir(name: str) -> Path:
    from specd.cache import cache_root

    # One build per torch and ISA: a cache shared between machines (a volume) never loads code
    # for instructions this CPU lacks.
    return cache_root() / "torch_extensions" / f"torch{torch.__version__}-{name}"


def _library_name(name: str) -> str:
    return f"specd_cpu_bf16_ops_{name.replace('-', '_')}"


def _cflags(name: str) -> list[str]:
    isa_flags = [f"-m{flag}" for flag in ISAS.get(name, ISAS["avx2"])]
    if name == EMULATED:
        isa_flags.append("-DSPECD_EMULATE_AVX512")
        if simde_include() != Path("/usr/include"):  # (naming a default one breaks libstdc++'s include_next)
            isa_flags.append(f"-isystem{simde_include()}")
    return ["-O3", "-fopenmp"] + isa_flags


def build_digest(name: str) -> str:
    """What a build depends on: every source and header, the flags and torch's version."""
    h = hashlib.sha256(f"{torch.__version__} {_cflags(name)}".encode())
    for path in sorted(Path(__file__).parent.glob("cpu_*.[ch]*")):
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()


def build(name: str, directory: Path | None = None, load: bool = True) -> Path:
    """Compile the ops for ISA `name` into directory (default: build_dir(name)) and, with load,
    load them. load=False builds without loading, e.g. the AVX-512 library on an image builder
    whose CPU may lack AVX-512 (deploy/Dockerfile's cpu-ops stage). Returns the library's path."""
    directory = directory or build_dir(name)
    directory.mkdir(parents=True, exist_ok=True)
    # One build at a time per directory, under a lock the kernel drops when its holder dies. torch's
    # own lock is a file that a killed build leaves behind, and every later start waits on it forever:
    # whoever holds ours knows no live build holds that file, and clears it.
    with open(directory / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        library = directory / f"{_library_name(name)}.so"
        if load and _current(directory, name):  # built by another process while this one waited
            torch.ops.load_library(str(library))
            return library
        (directory / "lock").unlink(missing_ok=True)
        return _build_locked(name, directory, load)


def _current(directory: Path, name: str) -> bool:
    stamp = directory / STAMP
    return ((directory / f"{_library_name(name)}.so").is_file() and stamp.is_file()
            and stamp.read_text().strip() == build_digest(name))


def _build_locked(name: str, directory: Path, load: bool) -> Path:
    from torch.utils import cpp_extension

    if not any(directory.glob("*.so")):  # torch's loader says nothing while it compiles
        log.warning("building the fused CPU ops for %s (once per machine and torch version, about a minute) "
                    "into %s", name, directory)
    # torch's loader loads whatever it builds; a library for instructions this CPU lacks may fault
    # as its initialisers run, so without load its load_library is a no-op for the call.
    load_library = torch.ops.load_library
    if not load:
        torch.ops.load_library = lambda path: None
    try:
        cpp_extension.load(name=_library_name(name), sources=[str(s) for s in SOURCES],
                           build_directory=str(directory), extra_cflags=_cflags(name), extra_ldflags=["-fopenmp"],
                           is_python_module=False, verbose=False)
    finally:
        torch.ops.load_library = load_library
    library = directory / f"{_library_name(name)}.so"
    (directory / STAMP).write_text(build_digest(name) + "\n")
    return library


def _load(name: str) -> None:
    """Load the ops for `name`: a library built earlier for the same sources, flags and torch
    (its stamp says so) loads as it is, with no compiler (the images carry none); else build."""
    directory = build_dir(name)
    if _current(directory, name):
        torch.ops.load_library(str(directory / f"{_library_name(name)}.so"))
        return
    build(name, directory)


def cpu_supported() -> bool:
    return isa() is not None


@functools.cache
def available() -> bool:
    """Whether torch.ops.specd_cpu is loaded (building it on first use)."""
    why = None
    if os.environ.get("SPECD_CPU_KERNELS", "1") == "0":
        why = "SPECD_CPU_KERNELS=0"
    elif not cpu_supported():
        why = (f"built for Linux x86-64 with AVX-512 or AVX2 + FMA only (this is {platform.system()} "
               f"{platform.machine()}" + (f", SPECD_CPU_ISA={os.environ['SPECD_CPU_ISA']}" if
                                          os.environ.get("SPECD_CPU_ISA") else "") + ")")
    else:
        try:
            _load(isa())
        except Exception as e:  # a missing compiler or ninja surfaces as various errors
            why = f"building {SOURCES[0].name} failed: {str(e).splitlines()[-1] if str(e) else type(e).__name__}"
    if why:
        log.warning("fused bfloat16 CPU ops off (%s); decode uses the slower torch path", why)
    return why is None
