"""Rejection sampler: Triton kernel vs the PyTorch reference, and their equality.

    python bench/rejection_kernels.py                     # CPU: times the reference only
    python bench/rejection_kernels.py --device cuda       # GPU: both, plus an exact-equality check

Method. A random flattened ragged batch (num_draft uniform in 0..k, greedy and random
rows mixed, one-hot or sparse top-8 q) with randomness drawn once; each implementation
is timed over --iters calls after --warmup calls (CUDA-synchronised around the loop, none
inside it). On a GPU the kernel's output is compared with the reference's for every
configuration, which is the "kernel equals reference natively" record for bench/results/.

Writes bench/results/kernels.md and kernels.json.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import time
from pathlib import Path

import torch

from specd.kernels import rejection_sampler as rs
from specd.kernels.rejection_sampler_ref import rejection_sample_ref

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-sizes", default="1,8,64,256")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--k", type=int, default=5, help="max drafts per sequence")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-write", action="store_true")
    return p.parse_args(argv)


def make_batch(batch: int, vocab: int, k: int, sparse: bool, device: str, seed: int = 0) -> tuple:
    """(metadata, positional args) of one rejection_sample call over a random ragged batch."""
    g = torch.Generator().manual_seed(seed)
    num_draft = torch.randint(0, k + 1, (batch,), generator=g).tolist()
    n = sum(num_draft)
    probs = (torch.randn(n + batch, vocab, generator=g) * 4).softmax(-1)  # draft rows, then one per sequence
    drafts = torch.multinomial(probs[:n] if n else probs[:1], 1, generator=g)[:, 0][:n].tolist()
    per_seq = [drafts[sum(num_draft[:b]):sum(num_draft[:b + 1])] for b in range(batch)]
    draft_q = None
    if sparse:  # the draft plus 7 other ids, random mass
        draft_q = []
        for seq in per_seq:
            qs = []
            for t in seq:
                others = [i for i in torch.randint(0, vocab, (7,), generator=g).tolist() if i != t]
                ids = [t] + list(dict.fromkeys(others))
                w = torch.rand(len(ids), generator=g)
                qs.append((ids, (w / w.sum()).tolist()))
            draft_q.append(qs or None)
    is_greedy = (torch.rand(batch, generator=g) < 0.3).tolist()
    meta = rs.SpecDecodeMetadata.build(per_seq, is_greedy, device, draft_q=draft_q)
    uniforms, noise = rs.draw_randomness([None] * batch, num_draft, vocab, "cpu", g)
    bonus = (probs[n:] / noise).argmax(-1)
    args = (probs[:n], probs[:n].argmax(-1), bonus, uniforms, noise)
    return meta, tuple(a.to(device) for a in args)


def timed(fn, args: tuple, iters: int, warmup: int, device: str) -> float:
    for _ in range(warmup):
        fn(*args)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(*args)
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6  # microseconds per call


def main(argv=None) -> None:
    a = parse_args(argv)
    impls = {"reference": rejection_sample_ref}
    if a.device == "cuda" and rs.backend("cuda") == "triton":
        from specd.kernels.rejection_sampler_triton import rejection_sample_triton
        impls["triton"] = rejection_sample_triton
    rows = []
    for batch in [int(b) for b in a.batch_sizes.split(",")]:
        for sparse in (False, True):
            meta, tensors = make_batch(batch, a.vocab, a.k, sparse, a.device)
            args = (meta, *tensors)
            row = {"batch": batch, "q": "sparse top-8" if sparse else "one-hot"}
            for name, fn in impls.items():
                row[f"{name}_us"] = round(timed(fn, args, a.iters, a.warmup, a.device), 1)
            if "triton" in impls:
                ref, tri = impls["reference"](*args), impls["triton"](*args)
                row["equal"] = bool(torch.equal(ref[0], tri[0]) and torch.equal(ref[1], tri[1]))
            rows.append(row)
            print(row, flush=True)
    device_name = torch.cuda.get_device_name() if a.device == "cuda" else platform.processor() or "cpu"
    meta = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "device": device_name,
            "torch": torch.__version__, "vocab": a.vocab, "k": a.k, "iters": a.iters}
    if a.no_write:
        return
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "kernels.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    cols = list(rows[0])
    title = f"# Rejection sampler kernels ({meta['device']}, torch {meta['torch']}, V={a.vocab}, k<={a.k})"
    lines = [title, "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    (RESULTS / "kernels.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
