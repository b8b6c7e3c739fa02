"""bench/real_pair.py's outputs: <out>.json (everything), <out>.md (tables), <out>.png (speedups)."""
from __future__ import annotations

import json
from pathlib import Path


def write(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    out.with_suffix(".md").write_text(render(result, out.with_suffix(".png").name))
    try:
        plot(result, out.with_suffix(".png"))
    except ImportError as e:  # matplotlib is a bench extra
        result.setdefault("notes", []).append(f"no plot: {e}")


def _f(x, fmt=".2f") -> str:
    return "-" if x is None else format(x, fmt)


def _pos(xs) -> str:
    return " / ".join(_f(x) for x in xs or []) or "-"


def _t(temp: float) -> str:
    return "greedy" if temp == 0 else f"T={temp:g}"


def _elsewhere(x: dict) -> str:
    """Draft tokens the verifier took from other drafters (the named one was unhealthy)."""
    other = x.get("draft_tokens_other", 0)
    return "0" if not other else f"**{other} of {other + x.get('draft_tokens_own', 0)}**"


def render(r: dict, png: str) -> str:
    m, s = r["machine"], r["settings"]
    from specd.models import model_store

    lines = ["# Speculative decoding on the default pair: offline, over HTTP, and peers", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, transformers {m['transformers']}, "
             f"Python {m['python']}; {m['dtype']} on {m['device']}; torch threads {s['threads']} per process "
             f"(this one, the verifier, each drafter). Load average at start {m['load_avg_start']}, at end "
             f"{m.get('load_avg_end', '-')}.", f"Date: {m['date']}. Elapsed: {r.get('elapsed_s', '-')} s.",
             f"Command: `{r['command']}`", "",
             f"Target: `{r['models']['target']}`. Drafter: `{r['models']['drafter']}`"
             + ("" if r["models"]["drafter"] == str(model_store.drafter_dir()) else " (**not the default drafter**)")
             + "." + "".join(f" {m}: `{d}`." for m, d in r["models"].get("heads", {}).items()), f"Workloads (held out, specd_train.workloads): {', '.join(s['workloads'])}; {s['prompts']} prompts each, "
             f"max {s['max_tokens']} new tokens (EOS ends a request); temperature > 0 is seeded per request. "
             f"Offline k: {', '.join(map(str, s['k']))} (fixed, controller off); HTTP k: {s['http_k']}.", ""]
    http = [x for x in r["http"] if x["method"] != "plain"]
    if http:
        first = min(x["batch"] for x in http)  # batch 1 when it was run
        lines += [f"## Summary: over HTTP, batch {first}", "", "| workload | sampling | drafter | tok/s | plain tok/s | "
                  "median speedup | acceptance |", "|---|---|---|---|---|---|---|"]
        for x in http:
            if x["batch"] == first:
                lines.append(f"| {x['workload']} | {_t(x['temperature'])} | {x['method']} | {x['tok_s']:.1f} | "
                             f"{x['plain_tok_s']:.1f} | **{x['ratio']:.2f}x** | {x['acceptance_rate']:.2f} |")
        lines.append("")
    if r["offline"]:
        lines += ["## Offline (specd.LLM in-process)", "",
                  "Ratio: tok/s over the mean of the plain runs just before and just after the cell's spec runs "
                  "(plain row: mean (before → after)). α/pos: P(draft i accepted | "
                  "drafts < i accepted; ngram/suffix drafts can be shorter than k, which lowers the later ones). "
                  "acc len: accepted per drafting step; E = 1 + acc len. drafted: share of decode steps (per "
                  "sequence) that carried drafts; E step = 1 + accepted per decode step, drafted or not. Means over "
                  "decode steps (prefill steps left out): d = propose time per step / k, V(1) = plain verify time "
                  "per step, V(k+1) = verify time per step with speculation on; ideal = E step·V(1)/(k·d + V(k+1)) "
                  "(the E of docs/architecture.md's cost model where every step drafts). greedy =: output tokens identical to plain.", "",
                  "| workload | batch | sampling | method | k | tok/s | ratio | α per pos | acc len | E | drafted | "
                  "E step | d ms | V(1) ms | V(k+1) ms | ideal | meas/ideal | greedy = |", "|" + "---|" * 18]
        for x in r["offline"]:
            if x["method"] == "plain":
                drift = f" ({x['tok_s_before']:.1f} → {x['tok_s_after']:.1f})" if "tok_s_before" in x else ""
                lines.append(f"| {x['workload']} | {x['batch']} | {_t(x['temperature'])} | plain | 0 | "
                             f"{x['tok_s']:.1f}{drift} | 1.00 | - | - | 1 | - | 1 | - | {x['V_ms']:.1f} | - | - | "
                             "- | - |")
                continue
            same = {True: "yes", False: "**NO**", None: "-"}[x.get("greedy_identical")]
            lines.append(f"| {x['workload']} | {x['batch']} | {_t(x['temperature'])} | {x['method']} | {x['k']} | "
                         f"{x['tok_s']:.1f} | {x['ratio']:.2f} | {_pos(x['alpha_per_pos'])} | "
                         f"{x['mean_accepted_len']:.2f} | {x['E']:.2f} | {x['drafted_share']:.2f} | "
                         f"{x['E_step']:.2f} | {x['d_ms']:.2f} | {x['V1_ms']:.1f} | "
                         f"{x['Vk1_ms']:.1f} | {x['ideal']:.2f} | {x['measured_over_ideal']:.2f} | {same} |")
        lines.append("")
    if r["http"]:
        lines += ["## Over HTTP (specd drafter / verifier / gateway processes, openai client)", "",
                  "Per cell: plain, then each drafter (order rotated), repeated; each spec run against the mean of "
                  "the plain runs before and after it; the median ratio is reported, every ratio listed. "
                  "Batch 8: 8 requests in flight. α per pos from the verifier's per-position counters; RTT: the "
                  "verifier's propose round trip (drafting included); step: mean verifier step (prefill included). "
                  "drafted elsewhere: draft tokens the verifier took from another drafter while the named one was "
                  "unhealthy (missed propose deadlines): such a row mixes drafters. E = 1 + accepted per drafting "
                  "step is the ideal speedup (drafting and verifying k + 1 tokens as cheap as a plain step); "
                  "meas/ideal = median ratio / E. features: bytes of the target's hidden states the verifier sent "
                  "per propose round trip (hidden-state heads; counted by the verifier), whose cost is inside RTT.",
                  "", "| workload | batch | sampling | drafter | k | tok/s | plain tok/s | median ratio | "
                  "every ratio | "
                  "acceptance | α per pos | E | meas/ideal | RTT ms | features B/step | step ms | greedy text = | "
                  "drafted elsewhere |",
                  "|" + "---|" * 18]
        for x in http:
            mism = x.get("greedy_mismatches")
            lines.append(f"| {x['workload']} | {x['batch']} | {_t(x['temperature'])} | {x['method']} | {x['k']} | "
                         f"{x['tok_s']:.1f} | {x['plain_tok_s']:.1f} | {x['ratio']:.3f} | "
                         f"{', '.join(f'{v:.2f}' for v in x['ratios'])} | {x['acceptance_rate']:.2f} | "
                         f"{_pos(x['alpha_per_pos'])} | {x['E']:.2f} | {x['ratio'] / x['E']:.2f} | "
                         f"{_f(x['rtt_ms'])} | {x.get('feature_bytes_per_step', 0):,.0f} | {_f(x['step_ms'])} | "
                         f"{'-' if mism is None else ('yes' if mism == 0 else f'**{mism} differ**')} | "
                         f"{_elsewhere(x)} |")
        lines.append("")
    if r["batch32"]:
        plain = r["batch32"][0]
        lines += [f"## Batch {plain['batch']}: the adaptive controller vs no speculation (HTTP, greedy)", "",
                  f"{plain['requests']} concurrent requests over {plain['workload']}, no k in the request (the "
                  f"controller decides) vs k = 0; {plain['repeats']} interleaved repeats, median ratio; "
                  f"must stay >= 0.97. Plain: {plain['tok_s']:.1f} tok/s.", "",
                  "| drafter | tok/s | median ratio | every ratio | draft tokens / token | acceptance | >= 0.97 | "
                  "drafted elsewhere |", "|---|---|---|---|---|---|---|---|"]
        for x in r["batch32"][1:]:
            lines.append(f"| {x['method']} | {x['tok_s']:.1f} | {x['ratio']:.3f} | "
                         f"{', '.join(f'{v:.3f}' for v in x['ratios'])} | {x['draft_tokens_per_token']:.3f} | "
                         f"{x['acceptance_rate']:.2f} | {'yes' if x['pass'] else '**NO**'} | {_elsewhere(x)} |")
        lines.append("")
    if r["peers"]:
        lines += ["## Peers (batch 1, greedy)", "",
                  "tok/s: generated tokens / wall time (prefill included); decode tok/s: decode steps only "
                  "(llama.cpp reports only this). specd rows: the offline rows above.", "",
                  "| workload | system | k | tok/s | decode tok/s | acceptance | note |",
                  "|---|---|---|---|---|---|---|"]
        ours = [x for x in r["offline"] if x["batch"] == 1 and x["temperature"] == 0 and x["method"] in
                ("plain", "draft_model", "ngram") and x["k"] in (0, s["http_k"])]
        for x in sorted(r["peers"] + ours, key=lambda x: x["workload"]):
            acc = x.get("acceptance_rate") if x["stage"] == "offline" else (
                None if x.get("accept_pct") is None else x["accept_pct"] / 100)
            name = f"specd {x['method']}" if x["stage"] == "offline" else x["method"]
            lines.append(f"| {x['workload']} | {name} | {x['k']} | {_f(x.get('tok_s'), '.1f')} | "
                         f"{_f(x.get('decode_tok_s'), '.1f')} | {_f(acc)} | {x.get('note', '')} |")
        lines.append("")
    if r["notes"]:
        lines += ["## Notes", ""] + [f"- {n}" for n in r["notes"]] + [""]
    lines += [f"![speedups]({png})", ""]
    return "\n".join(lines)


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    off = [x for x in r["offline"] if x["method"] != "plain"]
    http = [x for x in r["http"] if x["method"] != "plain"]
    panels = [p for p in (("offline", off), ("http", http)) if p[1]]
    if not panels:
        return
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8, 0.35 * max(len(p[1]) for p in panels)), 4.5 * len(panels)),
                             squeeze=False)
    for ax, (name, rows) in zip(axes[:, 0], panels):
        xs = range(len(rows))
        labels = [f"{x['workload']} b{x['batch']} {_t(x['temperature'])}\n{x['method']} k{x['k']}" for x in rows]
        ax.bar([i - 0.2 for i in xs], [x["ratio"] for x in rows], 0.4, label="measured")
        if name == "offline":
            ax.bar([i + 0.2 for i in xs], [x["ideal"] for x in rows], 0.4, label="ideal (cost model)", alpha=0.6)
        else:
            lo = [x["ratio"] - min(x["ratios"]) for x in rows]
            hi = [max(x["ratios"]) - x["ratio"] for x in rows]
            ax.errorbar([i - 0.2 for i in xs], [x["ratio"] for x in rows], yerr=[lo, hi], fmt="none", ecolor="k")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(list(xs), labels, rotation=90, fontsize=6)
        ax.set_ylabel("speedup over plain")
        ax.set_title(f"{name}: tok/s with speculation / without" + (" (median, min-max)" if name == "http" else ""))
        ax.legend(fontsize=8)
    fig.suptitle(f"{Path(r['models']['target']).name} + {Path(r['models']['drafter']).name}, "
                 f"{r['machine']['date']}, {r['settings']['threads']} thread(s)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
