"""When a service's KV caches take their memory: at start (the default), or as blocks are first
written (--lazy-kv-cache). Why: specd/engine/kv_memory.py."""
from __future__ import annotations

import argparse
import logging

log = logging.getLogger("specd.kv")


def add_lazy_kv_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lazy-kv-cache", action="store_true",
                   help="take the KV cache's memory as its blocks are first written, not at start (RSS then "
                        "grows as traffic fills the cache)")


def take_kv_memory(args) -> None:
    """At start, unless --lazy-kv-cache: every page of the process's CPU KV caches, so RSS holds still
    while serving. Run on the compute thread (the write uses torch's threads)."""
    if args.lazy_kv_cache:
        return
    from specd.engine import kv_memory  # here: argument parsing never imports torch

    taken = kv_memory.take_all()
    if taken:
        log.info("KV cache: %.2f GB taken at start (--lazy-kv-cache: as blocks fill)", taken / 2**30)
