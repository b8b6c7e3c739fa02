"""`specd models fetch | path`: the default pair in the local cache (see specd/models/model_store.py)."""
from __future__ import annotations

import argparse
import sys

HELP = "fetch the default target and its drafter into the cache (and build the CPU ops), or print where they are"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="models_command", required=True)
    fetch = sub.add_parser("fetch", help="download (once), convert and verify the default pair")
    fetch.add_argument("--force", action="store_true", help="fetch and convert again even if present")
    path = sub.add_parser("path", help="print the directory of the default target or drafter")
    path.add_argument("role", choices=["target", "drafter"])


def run(args) -> int:
    from specd.models import model_store

    if args.models_command == "fetch":
        target, drafter = model_store.fetch(log=lambda m: print(m, file=sys.stderr), force=args.force)
        print(f"target:  {target}\ndrafter: {drafter}")
        # Build the fused CPU ops now, so the first `specd up` does not spend its start-up compiling.
        from specd.kernels import cpu_ops

        if cpu_ops.cpu_supported() and cpu_ops.available():
            print(f"fused CPU ops: built for {cpu_ops.isa()}")
        return 0
    if not model_store.is_fetched():
        raise FileNotFoundError("the default pair is not fetched yet; run `specd models fetch`")
    print(model_store.target_dir() if args.role == "target" else model_store.drafter_dir())
    return 0
