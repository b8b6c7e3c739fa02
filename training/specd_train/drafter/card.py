"""The drafter's model card (README.md), written from its eval.json after training."""
from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

import torch


KEPT = "## Known limits"  # a hand-written section of the card, kept when it is rewritten


def measure_cost(target_dir: Path, drafter_dir: Path, tokens: int = 64, threads: int = 1) -> dict:
    """Per-token decode time of drafter and target on our engine, batch 1, float32, same thread count.
    A ratio measured side by side; absolute times mean little on a shared CPU."""
    import time

    from specd import LLM, SamplingParams

    torch.set_num_threads(threads)
    out = {}
    for role, path in (("drafter", drafter_dir), ("target", target_dir)):
        llm = LLM(str(path), dtype="float32")
        prompt = [{"prompt_token_ids": list(range(1000, 1200))}]
        llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0))  # warm-up
        t0 = time.perf_counter()
        llm.generate(prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
        out[f"{role}_ms_per_token"] = (time.perf_counter() - t0) / tokens * 1e3
    out["ratio"] = out["drafter_ms_per_token"] / out["target_ms_per_token"]
    out["threads"] = threads
    return out


def write_card(out: Path, report: dict, command: str) -> None:
    cfg, train = report["train"]["config"], report["train"]
    params = report["params"]
    lines = [
        "# SmolLM2-135M-Instruct-drafter",
        "",
        "specd's draft model for SmolLM2-135M-Instruct (the default target): "
        f"{len(cfg['layers'])} Llama decoder layers initialised from the target's layers {cfg['layers']}, "
        "the target's final norm, and the target's own token embeddings, shared and frozen, as input "
        f"embeddings and (tied) output head. The head scores only a draft vocabulary of {cfg['draft_vocab']} ids "
        "(`draft_vocab.json`: the ids the target most often ranks first on the training text); other ids are "
        "never drafted. Verification is unchanged, so output stays exactly the target's.",
        "",
        "Only the trained parts are committed here (`model.safetensors`, bfloat16: "
        f"{params['trained']:,} parameters). `specd models fetch` adds the target's embeddings "
        f"({params['embeddings']:,} parameters) and tokenizer to make a complete Hugging Face directory in "
        "the cache (transformers loads it as a plain Llama with a full head).",
        "",
        "## Data and objective",
        "",
        f"{train['prompts']} chat prompts: {train['prompts'] - train.get('questions', 0)} built from the Python "
        "standard library's training split and fixed topic lists (questions, code edits, code explanations, "
        f"summaries, small coding tasks), and {train.get('questions', 0)} everyday questions from fixed subject "
        "and task lists (`training/specd_train/drafter/questions.py`), answered by the "
        "target itself with our engine (bfloat16; 2 of 3 greedy, 1 of 3 sampled at T=0.7, seeded): "
        f"{train['tokens']:,} tokens of prompt + answer. At every position the target's top-{cfg['topk']} "
        "distribution (transformers, bfloat16) is the teacher. Loss: cross-entropy to that distribution "
        f"renormalised on the draft vocabulary, plus {cfg['argmax_weight']} x cross-entropy on the target's "
        f"argmax; weight 1 on answer tokens, {cfg['prompt_weight']} on prompt tokens.",
        f"AdamW, lr {cfg['lr']} (warmup {cfg['warmup']}, cosine to 10%), {cfg['epochs']} epochs of batches of "
        f"~{cfg['batch_tokens']} tokens ({train['steps']} steps), {train.get('precision', 'bf16 autocast')}, "
        f"{train['wall_s'] / 60:.1f} min of training, {train['wall_s_total'] / 60:.1f} min for the whole run.",
        "",
        "## Held-out acceptance (greedy, k = 4)",
        "",
        "The target's own greedy answers (float32) to prompts nothing was trained on (`training/specd_train/workloads.py`), "
        "replayed through speculative steps: alpha_j is the rate at which draft j is accepted given drafts "
        "1..j-1 were; tokens/step counts the target's own token too.",
        "",
        "| workload | alpha_1 | alpha_2 | alpha_3 | alpha_4 | alpha (all) | tokens/step | loss | draft-vocab coverage |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, ev in report["heldout"].items():
        a = ev["acceptance"]["4"]
        per = " | ".join(f"{x:.3f}" for x in a["alpha_per_position"])
        lines.append(f"| {name} | {per} | {a['alpha']:.3f} | {a['tokens_per_step']:.2f} | {ev['loss']:.3f} | "
                     f"{ev['draft_vocab_coverage']:.3f} |")
    lines += ["", "Tokens per step by k (greedy):", "", "| workload | " + " | ".join(
        f"k={k}" for k in report["heldout"]["chat"]["acceptance"]) + " |",
              "|---|" + "---|" * len(report["heldout"]["chat"]["acceptance"])]
    for name, ev in report["heldout"].items():
        lines.append(f"| {name} | " + " | ".join(f"{a['tokens_per_step']:.2f}" for a in ev["acceptance"].values()) + " |")
    cost = report.get("cost")
    if cost:
        lines += ["", "## Cost", "",
                  f"Decode time per token on specd's engine, batch 1, float32, {cost['threads']} thread, measured "
                  f"side by side: drafter {cost['drafter_ms_per_token']:.1f} ms, target "
                  f"{cost['target_ms_per_token']:.1f} ms, ratio **{cost['ratio']:.3f}**. Weights read per drafted "
                  f"token: {params['bytes_per_token'] / 1e6:.1f} MB vs the target's {params['target_bytes'] / 1e6:.1f} MB "
                  "(float32)."]
    draft = report.get("draft_cost")
    if draft:  # the AR drafter: its "sequential" draft is the one it serves
        lines += ["", f"As served: a {draft['k']}-token draft (the drafter's propose call: a 2-token catch-up, then "
                  f"{draft['k']} forwards) costs {draft['sequential_draft_ms']:.1f} ms against a target decode step of "
                  f"{draft['target_step_ms']:.1f} ms, batch 1, {draft['dtype']}, {draft['threads']} thread each, side by "
                  f"side: **{draft['sequential_share']:.2f}** of a target step."]
    if cost and report.get("cost_measured"):
        where = report["cost_measured"]
        lines += ["", f"Costs measured on {where['cpu']} (family/model {where.get('family_model', '?')}; "
                  f"{' '.join(where.get('flags', []))}), {where['cores']} cores, torch {where['torch']}, {where['date']}."]
    m = report["machine"]
    lines += ["", "## Reproduce", "", f"`{command}` (deterministic: fixed seeds, fixed thread count; the same "
              "machine, thread count and library versions give the same weights). Needs the dev extras "
              "(transformers).", "",
              f"Machine: {m['cpu']}, {m['cores']} cores, {m['threads']} torch threads; Python {m['python']}, "
              f"torch {m['torch']}. Date: {m['date']}.", "",
              "License: Apache-2.0, as the target (SmolLM2-135M-Instruct, Hugging Face)."]
    text = "\n".join(lines) + "\n"
    card = out / "README.md"
    # Notes written by hand after the generated part (its known limits) stay across rewrites.
    before = card.read_text() if card.exists() else ""
    if (at := before.find(KEPT)) >= 0:
        text += "\n" + before[at:]
    card.write_text(text)


def machine(threads: int) -> dict:
    """The CPU (model name, family/model, the ISA flags that pick the matmul path), cores, versions, date."""
    info = {}
    for ln in open("/proc/cpuinfo"):
        key, _, value = ln.partition(":")
        info.setdefault(key.strip(), value.strip())
    flags = sorted(f for f in info.get("flags", "").split() if f.startswith(("avx512", "amx", "avx2", "fma")))
    return {"cpu": info.get("model name", "?"), "family_model": f"{info.get('cpu family', '?')}/{info.get('model', '?')}",
            "flags": flags, "cores": os.cpu_count(), "threads": threads, "python": platform.python_version(),
            "torch": torch.__version__, "date": datetime.date.today().isoformat()}


def param_counts(drafter, draft_vocab: int, target_params: int) -> dict:
    trained = sum(p.numel() for n, p in drafter.named_parameters() if "embed_tokens" not in n)
    embeddings = drafter.model.embed_tokens.weight.numel()
    hidden = drafter.config.hidden_size
    return {"trained": trained, "embeddings": embeddings,
            "bytes_per_token": 4 * (trained + draft_vocab * hidden), "target_bytes": 4 * target_params}


def rewrite(out: Path, command: str) -> None:
    """Rewrite the card from eval.json (e.g. after editing this template)."""
    write_card(out, json.loads((out / "eval.json").read_text()), command)
