"""A library of the fused CPU ops built earlier loads without a compiler when its stamp matches
the sources, flags and torch (the service images carry such libraries and no compiler), and is
not loaded when the stamp does not match."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from specd.kernels import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.cpu_supported() or not cpu_ops.available(),
                                reason="the fused CPU ops do not build on this machine")

PROBE = """
import logging, torch
logging.basicConfig(level=logging.WARNING)
from specd.kernels import cpu_ops
print("available", cpu_ops.available(), hasattr(torch.ops.specd_cpu, "rms_norm"))
"""


def _probe(cache) -> subprocess.CompletedProcess:
    # CXX=false: any attempt to compile fails at once, as in an image without a compiler.
    env = {**os.environ, "SPECD_CACHE": str(cache), "CXX": "false", "CC": "false"}
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture
def prebuilt_cache(tmp_path):
    """A cache holding only what an image carries: the library and its stamp."""
    built = cpu_ops.build_dir(cpu_ops.isa())
    target = tmp_path / "torch_extensions" / built.name
    target.mkdir(parents=True)
    for name in (f"specd_cpu_bf16_ops_{cpu_ops.isa().replace('-', '_')}.so", cpu_ops.STAMP):
        shutil.copy(built / name, target / name)
    return tmp_path, target


def test_a_matching_stamp_loads_without_a_compiler(prebuilt_cache):
    cache, _ = prebuilt_cache
    out = _probe(cache)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "available True True" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "building" not in out.stderr


def test_a_stale_stamp_builds_again_and_never_loads_the_old_library(prebuilt_cache):
    cache, target = prebuilt_cache
    (target / cpu_ops.STAMP).write_text("0" * 64 + "\n")  # built from other sources
    out = _probe(cache)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "available False False" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "building the fused CPU ops" in out.stderr or "failed" in out.stderr


@pytest.mark.timeout(900)
def test_every_isa_compiles_here(tmp_path):
    """What an image's cpu-ops stage does: each ISA's library compiles on this machine, loaded or
    not (an AVX-512 build that failed to compile went unnoticed on AVX2 machines, whose tests
    compile the AVX-512 code only through SIMDe with the AVX2 flags). Each directory starts with
    the lock file of a build that was killed (torch's loader waits on it forever): it is cleared."""
    for isa in cpu_ops.ISAS:
        if isa == cpu_ops.isa():
            continue  # built and loaded by the fixture's available()
        (tmp_path / isa).mkdir()
        (tmp_path / isa / "lock").touch()
        library = cpu_ops.build(isa, tmp_path / isa, load=False)
        assert library.is_file() and (tmp_path / isa / cpu_ops.STAMP).read_text().strip() == cpu_ops.build_digest(isa)
