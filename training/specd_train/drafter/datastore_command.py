"""`specd datastore`: the suffix index's datastore for a target, from its own answers.

    specd datastore --shards 41 --out models/SmolLM2-135M-Instruct-datastore

The answers of `specd drafter-data`'s shards 0..N-1 (the target's own greedy answers to
self-asked and built questions, resumable; the questions are left out: a served answer repeats
answers, not questions), written as specd/proposers/datastore.py reads them, with eval.json and a
card (README.md): the held-out workloads' greedy answers (bf16, as `specd up` serves) replayed
through the serving suffix proposer with and without the datastore, the tokens a step and the
time a lookup takes, and what making the data took.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

HELP = "build the suffix index's datastore from the target's own answers (drafter-data shards), with its card"
K = 8  # the most drafts a step, as the verifier's index drafts (services/verifier/main.py LOCAL_DRAFTER_K)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="target model directory (default: the fetched default target)")
    p.add_argument("--shards", type=int, default=None, help="use shards 0..N-1 (default: every shard on disk)")
    p.add_argument("--out", default=None, help="output directory (default: models/<target>-datastore)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts per workload for the card")
    p.add_argument("--max-tokens", type=int, default=256, help="longest held-out answer")


def run(args) -> int:
    import torch

    from specd.models.demo_paths import models_root
    from specd.models.model_store import fetch
    from specd.models.tokenizer import vocab_hash_of
    from specd.proposers.datastore import save
    from specd_train.drafter import data
    from specd_train.drafter.card import machine

    torch.set_num_threads(args.threads)
    target = Path(args.target) if args.target else fetch()[0]
    out = Path(args.out) if args.out else models_root() / f"{target.name}-datastore"
    cfg = data.DataConfig()
    root = data.data_dir(target, cfg)
    on_disk = len(list(root.glob("shard-*.pt")))
    n = args.shards if args.shards is not None else on_disk
    missing = [i for i in range(n) if not data.shard_path(root, i).is_file()]
    if missing or n == 0:
        raise SystemExit(f"shards {missing or '0..'} are not in {root}: make them first with "
                         f"`specd drafter-data --shards {max(n, 1)}` (resumable)")
    t0 = time.perf_counter()
    shards = [torch.load(data.shard_path(root, i)) for i in range(n)]
    answers = [ids[pl:].tolist() for s in shards for ids, pl in zip(s["ids"], s["prompt_lens"])]
    config = {"vocab_hash": vocab_hash_of(target), "target": target.name, "shards": n,
              "conversations": len(answers), "tokens": sum(map(len, answers)),
              "data_recipe": {**cfg.__dict__, "data_dir_key": root.name},
              "made_in_s": round(sum(s["seconds"] for s in shards), 1),
              "made_at": {"batch": sorted({s["batch"] for s in shards}), "threads": sorted({s["threads"] for s in shards})},
              "command": f"specd drafter-data --shards {n} && specd datastore --shards {n}"}
    save(out, answers, config)
    report = {"config": config, "file_bytes": (out / "datastore.npz").stat().st_size,
              "held_out": held_out(target, out, args), "machine": machine(args.threads),
              "wall_s": round(time.perf_counter() - t0, 1)}
    (out / "eval.json").write_text(json.dumps(report, indent=1) + "\n")
    from specd_train.drafter.datastore_card import write_card

    write_card(out, report)
    print(json.dumps({k: v for k, v in report.items() if k != "held_out"}, indent=1))
    return 0


def held_out(target: Path, store: Path, args) -> dict:
    """Per workload: tokens a step replaying the target's greedy answers through the suffix proposer
    with and without the datastore (the answer cache off: nothing of one held-out answer drafts
    another), and the mean time of a propose call with it."""
    import torch

    from specd.llm import LLM
    from specd.models.chat import chat_prompt_ids
    from specd.proposers.suffix import SuffixProposer
    from specd.sampling import SamplingParams
    from specd_train.drafter.head_training import acceptance
    from specd_train.workloads import WORKLOADS, workload

    llm = LLM(str(target), dtype="bfloat16", max_num_seqs=32, max_model_len=2048)
    # built once (the datastore's order takes seconds); the replay releases every sequence it drafts for
    proposers = {label: SuffixProposer(K, suffix_decoding_max_cached_requests=0, **options)
                 for label, options in (("own", {}), ("datastore", {"suffix_decoding_datastore": str(store)}))}
    report = {}
    for name in WORKLOADS:
        prompts = [chat_prompt_ids(llm.tokenizer, m) for m in workload(name, args.eval_prompts)]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens))
        seqs = [torch.tensor(p + list(o.token_ids)) for p, o in zip(prompts, outs)]
        row = {"prompts": len(seqs), "answer_tokens": sum(len(o.token_ids) for o in outs)}
        for label, proposer in proposers.items():
            timed = _Timed(proposer)
            row[label] = acceptance(timed, seqs, [None] * len(seqs), [len(p) for p in prompts], K)
            row[label]["propose_us"] = round(timed.seconds / max(1, timed.calls) * 1e6, 1)
        report[name] = row
    return report


class _Timed:
    """A proposer whose propose calls are counted and timed (what the replay asks of it)."""

    def __init__(self, proposer):
        self.proposer, self.calls, self.seconds = proposer, 0, 0.0

    def propose(self, batch):
        t = time.perf_counter()
        out = self.proposer.propose(batch)
        self.seconds += time.perf_counter() - t
        self.calls += 1
        return out

    def release(self, seq_ids):
        self.proposer.release(seq_ids)
