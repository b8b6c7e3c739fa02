"""How far retrieval drafting can go at batch 1 on this CPU: the ceiling of the suffix index with the
committed datastore (what `specd up` drafts from by default), before any cost but the verify forward.

The target's greedy answers (bf16) to the held-out prompts are replayed through the index as the
verifier drives it (after the prefill and the first token, each step drafts from the committed text;
drafts are accepted while they equal the answer, then the answer's next token is committed too).
Each configuration counts tokens a step and rows verified a step, and its ceiling speedup is
sum(tokens) / sum(V(1 + rows) / V(1)), V(T) the target's forward over T query tokens measured by
bench/verify_rows.py in the same run: no drafting, sampling, scheduling, HTTP or controller time, so a
served run can only be slower. Configurations:
  chain k        the index's draft cut at k (k 8: what the verifier's index offers);
  oracle chain   the k 8 draft cut, in hindsight, at the tokens that were accepted: the most any choice
                 of k over this index's drafts can make (every accepted token, no rejected row);
  tree B         a tree of B nodes from the same match, best first by the path's share of occurrences
                 (SuffixDecoding's speculation trees); its rows are priced as a chain's of as many
                 tokens (a tree's may cost a little more: the CPU attention tiles chains only);
  oracle tree B  the tree's accepted path only;
  datastore tree B      the request's own drafts as chains (k 8), the datastore's as trees of B nodes;
  + A alternatives      the request's own drafts as chains, the datastore's chain (k 8) with up to A
                        other first tokens beside its first (each at least MIN_PROB of the occurrences),
                        as leaves of a tree;
  datastore 1/N  chain k 8 with the datastore cut to its first 1/N answers (what more answers would give).
Under sampling (T --temperature, seeded answers made by the engine), a one-hot draft's first token is
accepted with the target's probability of it; for the positions where the index drafts from the datastore,
the mean of that probability for the chain's first token alone and with 1 and 2 alternatives beside it
(the target's probabilities from transformers' forward over each answer, bf16).
Then what a model drafter would have to accept to reach --goal: the smallest per-token acceptance a
(geometric: draft j accepted with probability a where the j - 1 before it were) at which some k gives
E(a, k) / (V(1 + k) / V(1) + f) >= goal, f the drafter's cost for its whole k-token draft as a share
of a target step (--draft-cost; issue 29 asks for 0.05).

    python bench/retrieval_ceiling.py --threads 2 [--prompts 32] [--out bench/results/retrieval_ceiling]
"""
from __future__ import annotations

import argparse
import heapq
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info, machine_line, write_result  # noqa: E402

from specd.proposers.datastore import SEP  # noqa: E402  (between the datastore's answers)

K = 8  # the verifier's index drafts up to this many (services/verifier/main.py LOCAL_DRAFTER_K)
MIN_PROB = 0.1  # the index's suffix_decoding_min_token_prob (its default)
TREES = (4, 8, 16)
FRACTIONS = (8, 4, 2)


def verify_curve(threads: int, context: int, rows: int) -> dict[int, float]:
    """V(T) / V(1) for T = 1..rows, by bench/verify_rows.py (its processes, its medians)."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows"
        subprocess.run([sys.executable, str(Path(__file__).parent / "verify_rows.py"), "--threads", str(threads),
                        "--rounds", "2", "--context", str(context), "--rows", f"1-{rows}", "--out", str(out)],
                       check=True, capture_output=True)
        table = json.loads(out.with_suffix(".json").read_text())["rows"]
    return {row["T"]: row["this tree"] / table[0]["this tree"] for row in table}


def answers(threads: int, prompts: int, max_tokens: int) -> dict[str, list[tuple[list[int], list[int]]]]:
    import torch

    from specd.llm import LLM
    from specd.models import model_store
    from specd.models.chat import chat_prompt_ids
    from specd.sampling import SamplingParams
    from specd_train.workloads import WORKLOADS, workload

    torch.set_num_threads(threads)
    llm = LLM(model_store.default_target(), dtype="bfloat16", max_num_seqs=prompts, max_model_len=2048)
    out = {}
    for name in WORKLOADS:
        ids = [chat_prompt_ids(llm.tokenizer, m) for m in workload(name, prompts)]
        outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=max_tokens))
        out[name] = [(p, list(o.token_ids)) for p, o in zip(ids, outs)]
    return out


class Index:
    """The verifier's suffix index over one request (its own text first, the datastore only where the
    own text has no draft: specd/proposers/suffix.py), with the occurrences each draft came from."""

    def __init__(self, store, prompt: list[int]):
        from specd.proposers.suffix import SequenceIndex

        self.store, self.own = store, SequenceIndex(24)
        self.own.extend(prompt)

    def draft(self):
        """-> (chain of up to K, the token sequence its match is in, the match's end positions, whether
        the request's own text drafted it)."""
        text = self.own.tokens
        chain, _, m = self.own.speculate(K, 1.0, MIN_PROB)
        if chain:
            suffix = text[len(text) - m:]
            return chain, text, [e for e in range(m - 1, len(text) - 1) if text[e - m + 1:e + 1] == suffix], True
        chain, _, m = self.store.speculate(text, K, 1.0, MIN_PROB)
        return chain, self.store._fwd_list, (store_ends(self.store, text, m) if chain else []), False


def store_ends(store, text: list[int], m: int) -> list[int]:
    """Where the datastore's occurrences of text's last m tokens end (as its drafts sample them)."""
    import bisect

    import numpy as np

    from specd.proposers.datastore import MODE_SAMPLE

    pattern = np.asarray(text[-m:][::-1], dtype=">u4").tobytes()
    key = lambda r: store._rbuf[4 * r: 4 * r + 4 * m]  # noqa: E731
    lo = bisect.bisect_left(store._order, pattern, key=key)
    hi = bisect.bisect_right(store._order, pattern, lo, key=key)
    ends = store._end[lo:hi]
    if len(ends) > MODE_SAMPLE:
        ends = ends[np.linspace(0, len(ends) - 1, MODE_SAMPLE).astype(np.int64)]
    return ends.tolist()


def next_tokens(text, ends: list[int]) -> dict[int, list[int]]:
    """The tokens that follow the occurrences ending at `ends`, each with where it is."""
    groups: dict[int, list[int]] = {}
    for e in ends:
        if e + 1 < len(text) and text[e + 1] != SEP:
            groups.setdefault(text[e + 1], []).append(e + 1)
    return groups


def alternatives(text, ends: list[int], first: int, count: int) -> list[int]:
    """Up to `count` first tokens other than `first`, most frequent first, each following at least
    MIN_PROB of the occurrences."""
    ranked = sorted(next_tokens(text, ends).items(), key=lambda kv: -len(kv[1]))
    return [tok for tok, at in ranked if tok != first and len(at) >= MIN_PROB * len(ends)][:count]


def tree(text, ends: list[int], budget: int) -> list[tuple[int, int]]:
    """Up to `budget` (token, parent) nodes, best first by the share of occurrences on their path (at
    least MIN_PROB, at most K deep), parents before children."""
    nodes, heap, tie = [], [], 0

    def grow(parent: int, ends: list[int], prob: float, depth: int) -> None:
        nonlocal tie
        if depth >= K:
            return
        for tok, nxt in next_tokens(text, ends).items():
            p = prob * len(nxt) / len(ends)
            if p >= MIN_PROB:
                heapq.heappush(heap, (-p, tie, tok, parent, nxt, depth + 1))
                tie += 1

    grow(-1, ends, 1.0, 0)
    while heap and len(nodes) < budget:
        p, _, tok, parent, nxt, depth = heapq.heappop(heap)
        nodes.append((tok, parent))
        grow(len(nodes) - 1, nxt, -p, depth)
    return nodes


def accepted_in_tree(nodes: list[tuple[int, int]], future: list[int]) -> int:
    at, n = -1, 0
    for tok in future:
        at = next((i for i, node in enumerate(nodes) if node == (tok, at)), None)
        if at is None:
            break
        n += 1
    return n


def replay(store, pairs, mode: str, budget: int = K) -> dict:
    """Steps, tokens and rows a step over every answer in configuration `mode` (the module docstring),
    and each step's forward size (1 + rows verified), which priced() turns into V(1) units."""
    steps = tokens = rows = 0
    sizes = []
    for prompt, answer in pairs:
        text = prompt + answer
        at = len(prompt) + 1  # the prefill's step made the first token
        index = Index(store, text[:at])
        while at < len(text):
            future = text[at:]
            chain, source, ends, own = index.draft()
            # the datastore-only configurations keep the request's own drafts as chains of up to K
            datastore_only = mode in ("datastore tree", "alternatives")
            if chain and mode == "alternatives" and not own:
                nodes = [(tok, i - 1) for i, tok in enumerate(chain)]
                nodes += [(tok, -1) for tok in alternatives(source, ends, chain[0], budget)]
                n, verified = accepted_in_tree(nodes, future), len(nodes)
            elif not chain or mode.startswith("chain") or (own and datastore_only):
                chain = chain[:budget if mode.startswith("chain") else K]
                n = next((i for i, (d, t) in enumerate(zip(chain, future)) if d != t), min(len(chain), len(future)))
                verified = n if mode == "chain oracle" else len(chain)
            else:
                nodes = tree(source, ends, budget)
                n = accepted_in_tree(nodes, future)
                verified = n if mode == "tree oracle" else len(nodes)
            n = min(n, len(future) - 1)
            steps, tokens, rows = steps + 1, tokens + n + 1, rows + verified
            sizes.append(1 + verified)
            index.own.extend(text[at:at + n + 1])
            at += n + 1
    return {"steps": steps, "tokens": tokens, "tokens_per_step": tokens / steps, "rows_per_step": rows / steps,
            "sizes": sizes}


def sampled_first_position(store, threads: int, prompts: int, max_tokens: int, temperature: float) -> dict:
    """Per workload, over the positions of seeded sampled answers where the index drafts from the datastore:
    the mean target probability (at `temperature`) of the chain's first token, alone and with 1 and 2
    alternatives beside it (module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM

    from specd.llm import LLM
    from specd.models import model_store
    from specd.models.chat import chat_prompt_ids
    from specd.sampling import SamplingParams
    from specd_train.workloads import WORKLOADS, workload

    torch.set_num_threads(threads)
    target = model_store.default_target()
    llm = LLM(target, dtype="bfloat16", max_num_seqs=prompts, max_model_len=2048)
    asked = {name: [chat_prompt_ids(llm.tokenizer, m) for m in workload(name, prompts)] for name in WORKLOADS}
    made = {name: llm.generate(ids, [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=i,
                                                    ignore_eos=True) for i in range(len(ids))])
            for name, ids in asked.items()}
    del llm
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16)
    out = {}
    for name, ids in asked.items():
        sums, positions = [0.0, 0.0, 0.0], 0
        for prompt, answer in zip(ids, made[name]):
            text = prompt + list(answer.token_ids)
            with torch.no_grad():
                probs = torch.softmax(model(torch.tensor([text])).logits[0].float() / temperature, -1)
            index = Index(store, text[:len(prompt) + 1])
            for at in range(len(prompt) + 1, len(text)):
                chain, source, ends, own = index.draft()
                if chain and not own:
                    row, positions = probs[at - 1], positions + 1
                    firsts = [chain[0], *alternatives(source, ends, chain[0], 2)]
                    for a in range(3):
                        sums[a] += sum(row[t].item() for t in firsts[:a + 1])
                index.own.extend(text[at:at + 1])
        out[name] = {"positions": positions, "first": [x / max(positions, 1) for x in sums]}
    return out


def needed_alpha(curve: dict[int, float], goal: float, draft_cost: float) -> tuple[float, int] | None:
    """The smallest geometric per-token acceptance (to 0.01) at which some k <= len(curve) - 1 reaches goal."""
    for a100 in range(1, 100):
        a = a100 / 100
        for k in range(1, len(curve)):
            expected = (1 - a ** (k + 1)) / (1 - a)
            if expected / (curve[k + 1] + draft_cost) >= goal:
                return a, k
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--context", type=int, default=256, help="tokens before the verify block when timing V(T)")
    p.add_argument("--temperature", type=float, default=0.7, help="of the sampled answers")
    p.add_argument("--goal", type=float, default=1.5)
    p.add_argument("--draft-cost", type=float, default=0.05)
    p.add_argument("--out", type=Path, default=Path("bench/results/retrieval_ceiling"))
    args = p.parse_args(argv)
    import numpy as np

    from specd.models import model_store
    from specd.proposers.datastore import Datastore

    t0 = time.monotonic()
    info = machine_info(args.threads, dtype="bfloat16")
    curve = verify_curve(args.threads, args.context, max(TREES) + 1)
    replies = answers(args.threads, args.prompts, args.max_tokens)
    path = model_store.committed_datastore_dir()
    store = Datastore.load(path, 24)
    with np.load(path / "datastore.npz") as z:
        flat, lengths = z["tokens"], z["lengths"]
    configs = [(f"chain k {k}", "chain", k) for k in (1, 2, 4, 8)] + [("oracle chain", "chain oracle", K)]
    configs += [(f"tree {b}", "tree", b) for b in TREES] + [(f"oracle tree {max(TREES)}", "tree oracle", max(TREES))]
    configs += [("datastore tree 3", "datastore tree", 3), ("+ 1 alternative", "alternatives", 1),
                ("+ 2 alternatives", "alternatives", 2)]
    rows = []
    for name, pairs in replies.items():
        for label, mode, budget in configs:
            rows.append({"workload": name, "config": label, **priced(replay(store, pairs, mode, budget), curve)})
        for part in FRACTIONS:
            n = len(lengths) // part
            cut = Datastore(flat[: int(lengths[:n].sum())], lengths[:n], 24)
            rows.append({"workload": name, "config": f"datastore 1/{part}", **priced(replay(cut, pairs, "chain"), curve)})
        print(name, [(r["config"], round(r["ceiling"], 3)) for r in rows if r["workload"] == name], file=sys.stderr)
    sampled = sampled_first_position(store, args.threads, args.prompts, args.max_tokens, args.temperature)
    settings = {"prompts": args.prompts, "temperature": args.temperature, "sampled_first_position": sampled, "max_tokens": args.max_tokens, "context": args.context, "k": K,
                "min_token_prob": MIN_PROB, "datastore": str(path), "datastore_answers": int(len(lengths)),
                "curve": curve, "goal": args.goal, "draft_cost": args.draft_cost,
                "needed_alpha": needed_alpha(curve, args.goal, args.draft_cost)}
    write_result(args.out, "bench/retrieval_ceiling.py", argv, info, settings, rows, t0, render)
    return 0


def priced(r: dict, curve: dict[int, float]) -> dict:
    cost = sum(curve[min(s, len(curve))] for s in r.pop("sizes"))
    return {**r, "ceiling": r["tokens"] / cost}


def render(r: dict) -> str:
    s = r["settings"]
    curve = " ".join(f"{t}: {v:.2f}" for t, v in sorted((int(t), v) for t, v in s["curve"].items()))
    lines = ["# The suffix index's ceiling at batch 1 (bench/retrieval_ceiling.py)", "",
             f"The default target's greedy answers (bf16, {s['prompts']} held-out prompts per workload, up to "
             f"{s['max_tokens']} tokens) replayed through the suffix index with the committed datastore "
             f"({s['datastore_answers']:,} answers); ceiling = tokens / verify forwards' time in 1-token steps, "
             f"V(T) / V(1) measured in this run at {s['context']} tokens of context: {curve}. No other cost "
             "is counted: a served run can only be slower. Configurations: the module docstring.", "",
             "| workload | configuration | tokens/step | rows/step | ceiling |", "|---|---|---:|---:|---:|"]
    for row in r["rows"]:
        lines.append(f"| {row['workload']} | {row['config']} | {row['tokens_per_step']:.3f} | "
                     f"{row['rows_per_step']:.2f} | {row['ceiling']:.3f}x |")
    lines += ["", f"Sampled at T {s['temperature']} (seeded answers), where the index drafts from the datastore: the "
              "target's probability of the draft's first token (what a one-hot draft is accepted with), alone and "
              "with 1 and 2 alternatives beside it:", "",
              "| workload | positions | first token alone | + 1 alternative | + 2 alternatives |", "|---|---:|---:|---:|---:|"]
    for name, x in s["sampled_first_position"].items():
        lines.append(f"| {name} | {x['positions']:,} | " + " | ".join(f"{v:.3f}" for v in x["first"]) + " |")
    need = s["needed_alpha"]
    lines += ["", f"A model drafter costing {s['draft_cost']:.2f} of a target step for its whole draft reaches "
              f"{s['goal']}x at this V only with a per-token acceptance of at least "
              + (f"{need[0]:.2f} (at k {need[1]})" if need else "1 (none below it does)") + ".",
              "", f"Command: `{r['command']}`.", "", machine_line(r), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
