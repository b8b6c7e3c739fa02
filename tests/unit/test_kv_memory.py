"""A CPU KV cache's pages are resident once written and not before (kv_memory.zeroed), and
resident_bytes() counts exactly those: what specd_kv_cache_resident_bytes reports."""
from __future__ import annotations

import gc
import mmap

import torch

from specd.engine import kv_memory


def test_resident_bytes_follow_the_blocks_written():
    before_size, before_resident = kv_memory.cache_bytes(), kv_memory.resident_bytes()
    # 16 tokens x 4 heads x 64 dims, bf16: 2 pages a block; 1.5 MB in all, so no 2 MB huge page (THP
    # "always") can make more pages resident than were written
    blocks, block_bytes = 192, 16 * 4 * 64 * 2
    cache = kv_memory.zeroed((blocks, 16, 4, 64), torch.bfloat16, torch.device("cpu"))
    assert kv_memory.cache_bytes() - before_size == blocks * block_bytes
    assert kv_memory.resident_bytes() == before_resident  # zero-filled, none of it in memory yet
    cache[10:20] = 1.0
    cache[100] = 2.0
    written = 11 * block_bytes
    assert kv_memory.resident_bytes() - before_resident == -(-written // mmap.PAGESIZE) * mmap.PAGESIZE
    del cache
    gc.collect()
    assert kv_memory.cache_bytes() == before_size  # a freed cache is no longer counted
