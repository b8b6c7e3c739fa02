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
import math
import mmap
import weakref

import numpy as np
import torch

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
