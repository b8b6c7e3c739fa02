"""What the target's hidden states cost on the Propose hop (issue 15: feature bytes per step).

The verifier's own DrafterClient and message builder (services/verifier/propose_bounds.py, specd/rpc/wire.py)
against the real DrafterService on loopback gRPC, hosting a proposer that drafts nothing, so
the round trip is transport plus (de)serialisation only: the rows go out as the pool packs them
(bfloat16) and the service unpacks and checks them as it does for a hidden-state head. Per step
each sequence sends the rows of the tokens committed since its last step (1 + accepted drafts:
here 3) and, once, its prompt's rows (512 tokens, in pieces under the message bound).

Shapes: SmolLM2-135M (hidden 576; EAGLE/Medusa/MLP: 1 layer, EAGLE-3: 3 layers) and an 8B
Llama (hidden 4096), at batch 1, 8 and 32, against the same batch with no features.

    python bench/features_transport.py          # writes bench/results/features_transport.{md,json}
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = [("none", 576, 0), ("SmolLM2-135M, 1 layer", 576, 1), ("SmolLM2-135M, 3 layers (EAGLE-3)", 576, 3),
          ("8B, 1 layer", 4096, 1), ("8B, 3 layers (EAGLE-3)", 4096, 3)]
ROWS_PER_STEP = 3  # 1 + accepted drafts
PROMPT = 512


class Sink:
    """Takes whatever it is sent and drafts nothing (no proposer cost in the round trip)."""

    def __init__(self, layers: int, hidden: int):
        self.feature_layers = tuple(range(30 - layers + 1, 31)) if layers else ()
        self.hidden_size, self.target_layers = hidden, 30

    def propose(self, batch):
        from specd.proposers.base import Proposal

        return [Proposal(seq_id=r.seq_id, token_ids=[]) for r in batch]

    def release(self, seq_ids):
        pass


async def measure(hidden: int, layers: int, batch: int, iters: int) -> dict:
    import grpc
    import torch

    from specd.drafter.main import describe_features
    from specd.drafter.server import DrafterService
    from specd.proposers.base import ProposeRequest
    from specd.v1 import drafter_pb2, drafter_pb2_grpc
    from specd.verifier.drafter_client import DrafterClient, FeatureTarget
    from specd.verifier import drafter_pool
    from specd.rpc.wire import propose_entry_to_proto
    from specd.verifier.propose_bounds import wire_pieces

    sink = Sink(layers, hidden)
    info = drafter_pb2.DrafterInfoResponse(name="sink", method="eagle", vocab_size=49152, max_k=8)
    describe_features(sink, info)
    from specd.rpc.grpc_server import SERVER_OPTIONS

    server = grpc.aio.server(options=SERVER_OPTIONS)  # as `specd drafter` serves
    drafter_pb2_grpc.add_DrafterServicer_to_server(DrafterService(sink, info), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = DrafterClient("sink", f"127.0.0.1:{port}", "bench", 5.0, 49152, "",
                           target=FeatureTarget(hidden, 30, ""))
    await client.connect()
    width = layers * hidden
    gen = torch.Generator().manual_seed(0)

    def request(sid: int, n_new: int, length: int, full: bool) -> ProposeRequest:
        rows = n_new - 1 if full else n_new
        feats = torch.randn(rows, width, generator=gen).to(torch.bfloat16) if layers else None
        return ProposeRequest(seq_id=sid, new_tokens=[5] * n_new, num_tokens=length, k=4, full_history=full,
                              features=feats, feature_layers=sink.feature_layers)

    async def send(reqs: list[ProposeRequest]) -> tuple[float, int]:
        pieces = [wire_pieces(r, sink.feature_layers, drafter_pool.MAX_FEATURE_BYTES // len(reqs)) for r in reqs]
        t0, size = time.perf_counter(), 0
        for depth in range(max(len(p) for p in pieces) - 1):
            lead = drafter_pb2.ProposeBatch(client_id="bench")
            for p in pieces:
                if depth < len(p) - 1:
                    propose_entry_to_proto(lead, p[depth], 0)
            size += lead.ByteSize()
            await client.round_trip(lead)
        msg = drafter_pb2.ProposeBatch(client_id="bench")
        for p in pieces:
            propose_entry_to_proto(msg, p[-1], 4)
        size += msg.ByteSize()
        await client.round_trip(msg)
        return time.perf_counter() - t0, size

    prefill_s, prefill_bytes = await send([request(s, PROMPT, PROMPT, True) for s in range(batch)])
    rtts, sizes, length = [], [], PROMPT
    for it in range(iters + 10):
        length += ROWS_PER_STEP
        t, size = await send([request(s, ROWS_PER_STEP, length, False) for s in range(batch)])
        if it >= 10:
            rtts.append(t)
            sizes.append(size)
    await client.close()
    await server.stop(None)
    rtts.sort()
    return {"hidden": hidden, "layers": layers, "batch": batch, "step_bytes": statistics.fmean(sizes),
            "step_rtt_p50_us": rtts[len(rtts) // 2] * 1e6, "step_rtt_p99_us": rtts[int(0.99 * len(rtts))] * 1e6,
            "prompt_bytes": prefill_bytes, "prompt_s": prefill_s}


def render(r: dict) -> str:
    lines = ["# Hidden states on the Propose hop: bytes and round trip", "",
             "Command: `python bench/features_transport.py`", "", __doc__.split("\n\n")[1].replace("\n", " "), "",
             "| features | batch | bytes per step | step round trip p50 | p99 | vs no features (p50) | "
             "prompt of 512 tokens: bytes | its send time |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    base = {row["batch"]: row["step_rtt_p50_us"] for row in r["rows"] if row["layers"] == 0}
    for row in r["rows"]:
        lines.append(f"| {row['name']} | {row['batch']} | {row['step_bytes']:,.0f} | {row['step_rtt_p50_us']:.0f} µs | "
                     f"{row['step_rtt_p99_us']:.0f} µs | +{row['step_rtt_p50_us'] - base[row['batch']]:.0f} µs | "
                     f"{row['prompt_bytes']:,} | {row['prompt_s'] * 1e3:.1f} ms |")
    m = r["machine"]
    lines += ["", f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}; load average "
              f"{m['load_avg_start']} at start, {r['load_avg_end']:.2f} at end; {m['date']}.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--out", default=str(RESULTS / "features_transport"))
    args = p.parse_args(argv)
    import os

    import torch

    torch.set_num_threads(1)
    info = machine_info(1)
    rows = []
    for name, hidden, layers in SHAPES:
        for batch in (int(b) for b in args.batches.split(",")):
            row = {"name": name, **asyncio.run(measure(hidden, layers, batch, args.iters))}
            rows.append(row)
            print(f"{name:34s} batch {batch:2d}: {row['step_bytes']:9,.0f} B/step, p50 {row['step_rtt_p50_us']:6.0f} µs",
                  file=sys.stderr, flush=True)
    result = {"machine": info, "rows": rows, "rows_per_step": ROWS_PER_STEP, "prompt_tokens": PROMPT,
              "load_avg_end": os.getloadavg()[0]}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(render(result))
    print(f"wrote {out}.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
