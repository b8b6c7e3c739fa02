"""How fast this machine makes drafter training data: `specd drafter-data`'s first shard at several batch sizes.

    python bench/drafter_data.py --threads 2 --batches 64,128,256

The default target in bfloat16 makes shard 0 (256 conversations: self-asked questions, then the
answers, up to 256 tokens each; training/specd_train/drafter/data.py) once per batch size, each time into a
fresh cache, so every run does the whole shard. Reported: generated tokens (questions + answers)
per second of wall time, and whether the shard came out identical at every batch size (it must:
the data may not depend on how it was made).

Writes bench/results/drafter_data.{md,json} (--out: another name).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info, machine_line, write_result  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", default="64,128,256")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--out", type=Path, default=RESULTS / "drafter_data")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from specd.models import model_store
    from specd_train.drafter import data

    info = machine_info(args.threads, "cpu", "bfloat16")
    t0, rows, first = time.monotonic(), [], None
    cfg = data.DataConfig(max_tokens=args.max_tokens)
    target = model_store.target_dir()  # before SPECD_CACHE moves: the models stay where they are
    for batch in [int(b) for b in args.batches.split(",")]:
        with tempfile.TemporaryDirectory() as cache:
            os.environ["SPECD_CACHE"] = cache
            data.make_shards(target, 1, cfg, batch, log=lambda m: print(m, file=sys.stderr))
            shard = torch.load(data.shard_path(data.data_dir(target, cfg), 0))
        ids = [t.tolist() for t in shard["ids"]]
        first = first or ids
        rows.append({"batch": batch, "seconds": shard["seconds"], "answer_tokens": shard["answer_tokens"],
                     "question_tokens": shard["question_tokens"], "tokens_per_s": shard["tokens_per_s"],
                     "self_asked": shard["kinds"].count("self_asked"), "conversations": len(ids),
                     "identical_to_first": ids == first})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    write_result(args.out, "bench/drafter_data.py", argv, info, vars(args) | {"out": str(args.out)}, rows, t0, render)
    return 0


def render(r: dict) -> str:
    lines = ["# Making drafter training data: tokens per second by batch size", "", f"Command: `{r['command']}`", "",
             "`specd drafter-data`'s shard 0 (256 conversations: questions the target asks itself, then its answers "
             f"up to {r['settings']['max_tokens']} tokens; the default target in bfloat16), made once per batch size "
             "in a fresh cache. tok/s = generated tokens (questions + answers) / wall time of the shard.", "",
             "| batch | generated tokens | wall s | tok/s | self-asked questions kept | shard identical to the first |",
             "|---:|---:|---:|---:|---:|---|"]
    for x in r["rows"]:
        lines.append(f"| {x['batch']} | {x['answer_tokens'] + x['question_tokens']} | {x['seconds']:.0f} | "
                     f"{x['tokens_per_s']:.0f} | {x['self_asked']}/{x['conversations']} | "
                     f"{'yes' if x['identical_to_first'] else 'NO'} |")
    best = max(r["rows"], key=lambda x: x["tokens_per_s"])
    lines += ["", f"At the best batch here ({best['batch']}), 10 million generated tokens take "
              f"{1e7 / best['tokens_per_s'] / 3600:.1f} hours.", "",
              machine_line(r), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
