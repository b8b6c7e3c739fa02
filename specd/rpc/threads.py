"""How many torch threads a service computes on (--threads)."""
from __future__ import annotations

import argparse
import os


def default_threads(replicas: int = 1) -> int:
    """Each verifier's threads (`specd up`, `--threads auto`): its share of the cores we may run
    on, at most 8. The gateway and the drafters share them: drafters draft while the verifier
    waits for them. On a 2-core AMD
    EPYC, plain chat over HTTP: 73.5 tok/s with 2 verifier threads, 50 with 1 (2026-11-26; the
    verifier had given 2 threads 1 thread's speed until its engine ran on one thread only:
    specd.rpc.grpc_server.compute_thread)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(8, cores // replicas))


def threads_arg(value: str) -> int:
    """A service's --threads: a count, or auto (default_threads())."""
    if value == "auto":
        return default_threads()
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of threads or auto, not {value!r}") from None
