"""`specd drafter-data`: make (or continue making) the drafters' training data.

    specd drafter-data --shards 400 --batch 128 --threads 2 --hours 2.5

Resumable: shards already on disk are kept, so the same command run again (after a stop, a
deadline or a crash) continues where the last run stopped; `--status` only prints what is
there. Shards live under $SPECD_CACHE/drafter-data/<key>/, keyed by the target's weights and
the recipe (see training/specd_train/drafter/data.py).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

HELP = "make the drafters' training data: the target's own conversations, in resumable shards"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="target model directory (default: the fetched default target)")
    p.add_argument("--shards", type=int, default=400, help="shards wanted in all (256 conversations each)")
    p.add_argument("--batch", type=int, default=128, help="sequences decoded together (does not change the data)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=256, help="longest answer")
    p.add_argument("--hours", type=float, default=None, help="stop cleanly after this long (run again to continue)")
    p.add_argument("--status", action="store_true", help="only print what is on disk")


def run(args) -> int:
    import torch

    from specd.models.model_store import fetch
    from specd_train.drafter import data

    torch.set_num_threads(args.threads)
    target = Path(args.target) if args.target else fetch()[0]
    cfg = data.DataConfig(max_tokens=args.max_tokens)
    if args.status:
        report = data.summary(data.data_dir(target, cfg))
    else:
        deadline = time.time() + args.hours * 3600 if args.hours else None
        report = data.make_shards(target, args.shards, cfg, args.batch, deadline=deadline)
    report.pop("per_shard")
    print(json.dumps(report, indent=1))
    return 0
