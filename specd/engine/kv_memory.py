"""The memory of CPU KV caches: zero-filled tensors whose pages become resident only as blocks are
written, and how much of them is resident now.

A block manager hands out its free blocks in turn, never-used ones first and then the least
recently freed, before it evicts a cached one (block_manager.py). So a cache's resident size climbs
towards its full size as traffic cycles through the blocks, and stays there: a process whose RSS
grows for hours may be filling its cache, not leaking. resident_bytes() tells the two apart
(specd_kv_cache_resident_bytes). The services take their caches' memory at start (take_all), as
llama.cpp and GPU servers do: RSS then holds still while serving (what grows is a leak), and a
cache the machine cannot hold fails at start, not when traffic first fills it hours later; an
offline engine and `--lazy-kv-cache` keep the lazy pages."""
from __future__ import annotations

import ctypes
import logging
import math
import mmap
import weakref
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("specd.kv")

DEFAULT_CPU_KV_GB = 1.0
CPU_KV_SHARE_OF_AVAILABLE = 0.5  # a default cache takes at most this share of the memory left

_caches: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()  # the CPU caches made here, while they live
_libc = ctypes.CDLL(None, use_errno=True)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled cache tensor. Zero, not empty: padded key slots are masked, but 0 * NaN garbage
    would still be NaN. On CPU from anonymous mmap, whose pages read as zero and take memory only
    once written: the process's resident size follows the blocks used so far instead of the whole
    cache (torch.zeros writes every page at start)."""
    count = math.prod(shape)
    if torch.device(device).type != "cpu" or count == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    # Private: a forked process gets a copy, never a shared cache.
    pages = mmap.mmap(-1, count * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    cache = torch.frombuffer(pages, dtype=dtype, count=count).view(shape)
    _caches.add(cache)
    return cache


def available_memory_bytes() -> int | None:
    """Memory this process can still take: the kernel's MemAvailable, or less where a cgroup
    v2 (a container's memory limit) allows less. None where neither can be read (not Linux)."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except OSError:
        pass
    try:  # cgroup v2: the limit less what the group uses ("max": no limit)
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return max(0, min(found)) if found else None


def default_cpu_budget(what: str = "KV cache") -> float:
    """The bytes a CPU cache takes when none is asked for (the verifier's, a draft model's):
    DEFAULT_CPU_KV_GB, or less on a machine without room for it, at most a share of the memory left
    once the model is loaded (the other services and the OS need the rest)."""
    budget = DEFAULT_CPU_KV_GB * 2**30
    available = available_memory_bytes()
    if available is not None and budget > CPU_KV_SHARE_OF_AVAILABLE * available:
        log.warning("%s: %.2f GB (%d%% of the %.2f GB of memory left), not the default %.2f GB", what,
                    CPU_KV_SHARE_OF_AVAILABLE * available / 2**30, CPU_KV_SHARE_OF_AVAILABLE * 100,
                    available / 2**30, DEFAULT_CPU_KV_GB)
        budget = CPU_KV_SHARE_OF_AVAILABLE * available
    return budget


def check_fits(nbytes: int, remedy: str) -> None:
    """Refuse a cache larger than the memory left, at start, as a GPU's allocation would: with lazy
    pages it would not fail here but kill the server once traffic fills it; taken at start, the
    kernel's OOM killer would end it without a word."""
    available = available_memory_bytes()
    if available is not None and nbytes > available:
        raise ValueError(f"a KV cache of {nbytes / 2**30:.2f} GB does not fit in the {available / 2**30:.2f} GB "
                         f"of memory left after loading the model; {remedy}")


def take_all() -> int:
    """Write every page of every live CPU cache (zeros over zeros), so the process holds all of their
    memory from now on. -> the bytes taken."""
    for cache in list(_caches):
        cache.zero_()
    return cache_bytes()


def cache_bytes() -> int:
    """The size of every live CPU cache made by zeroed."""
    return sum(c.numel() * c.element_size() for c in list(_caches))


def resident_bytes() -> int:
    """How much of those caches is mapped (mincore(2)): the pages written at least once, and any page
    read while never written, which maps the kernel's shared zero page and takes no memory (the
    engine reads blocks it wrote, and the masked tail of a block it is writing)."""
    page = mmap.PAGESIZE
    total = 0
    for cache in list(_caches):
        length = cache.numel() * cache.element_size()
        pages = -(-length // page)
        vec = (ctypes.c_ubyte * pages)()
        if _libc.mincore(ctypes.c_void_p(cache.data_ptr()), ctypes.c_size_t(length), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed on a KV cache")
        total += int(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8) & 1)) * page
    return total
