"""`specd train-drafter --method parallel`: the default drafter, adapted to draft k tokens per forward.

    specd train-drafter --method parallel --threads 2 --out models/SmolLM2-135M-Instruct-drafter

Starts from the drafter as committed (its layers, norm and draft vocabulary), trains it on the
`specd drafter-data` shards on disk (parallel.py), evaluates sequential and parallel acceptance
on the held-out workloads before and after, measures what a k-token draft costs against a
target step on our engine, and writes the layers, a config with `pard_token` (the key vLLM's
parallel drafting reads) and the card.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path


def train_parallel(target_dir: Path, out: Path, args, log=print) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from specd.models.chat import chat_prompt_ids
    from specd.models.model_store import fetch
    from specd.models.tokenizer import Tokenizer
    from specd_train.drafter import parallel
    from specd_train.drafter.answers import cached_answers
    from specd_train.drafter.data import DataConfig, data_dir, load_sequences, summary
    from specd_train.drafter.distill import SubsetHead
    from specd_train.workloads import WORKLOADS, workload

    t0 = time.perf_counter()
    cfg = parallel.ParallelConfig(epochs=args.epochs or 1)
    root = data_dir(target_dir, DataConfig())
    data = [(torch.as_tensor(ids), plen) for ids, plen in load_sequences(root)][: args.max_conversations]
    if not data:
        raise SystemExit(f"no training data in {root}: run `specd drafter-data` first")
    made = summary(root)
    tok = Tokenizer.from_dir(target_dir)
    heldout = {}
    for name in WORKLOADS:
        msgs = workload(name, args.eval_prompts)
        seqs = cached_answers(target_dir, msgs, args, log, greedy_only=True, dtype="float32")
        heldout[name] = [(s, len(chat_prompt_ids(tok, m))) for s, m in zip(seqs, msgs)]
    _, start = fetch(log)  # the committed drafter, assembled with the target's embeddings
    drafter = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
    drafter.model.embed_tokens.weight.requires_grad_(False)
    ids = torch.tensor(json.loads((start / "draft_vocab.json").read_text())["ids"])
    head = SubsetHead(drafter, ids)
    before = {name: parallel.acceptance(head, ex, cfg) for name, ex in heldout.items()}
    log(f"before: { {n: round(v['parallel']['tokens_per_step'], 3) for n, v in before.items()} }")
    report = parallel.train(head, data, cfg, log)
    for p in drafter.model.parameters():  # what ships is bfloat16: evaluate exactly that
        if p.requires_grad:
            p.data = p.data.to(torch.bfloat16).float()
    after = {name: parallel.acceptance(head, ex, cfg) for name, ex in heldout.items()}
    log(f"after: { {n: round(v['parallel']['tokens_per_step'], 3) for n, v in after.items()} }")
    _save(drafter, start, out, cfg)
    import tempfile

    from specd.models.model_store import _assemble_drafter
    from specd_train.drafter.card import machine

    with tempfile.TemporaryDirectory() as tmp:
        full = Path(tmp) / "drafter"
        _assemble_drafter(target_dir, full, log, src=out)
        cost = measure_draft_cost(target_dir, full, cfg.drafts)
    log(f"cost: {cost}")
    from specd_train.drafter import precision

    result = {"train": {**report, "config": asdict(cfg), "conversations": len(data),
                        "precision": precision.label(),
                        "tokens": sum(len(x) for x, _ in data), "data": {k: made[k] for k in (
                            "shards", "conversations", "tokens", "generated_tokens", "seconds")},
                        "data_tokens_per_s": made["generated_tokens"] / max(1e-9, made["seconds"]),
                        "wall_s_total": time.perf_counter() - t0},
              "heldout_before": before, "heldout": after, "cost": cost, "machine": machine(args.threads)}
    (out / "eval.json").write_text(json.dumps(result, indent=1) + "\n")
    write_card(out, result, f"specd train-drafter --method parallel --threads {args.threads} --out {out}")
    log(f"wrote {out}")
    return result


def _save(drafter, start: Path, out: Path, cfg) -> None:
    import shutil

    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    # Only the drafter's own weights: the embeddings (and tied head) are the target's, added back
    # by `specd models fetch` (specd/models/model_store.py).
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in drafter.state_dict().items()
             if k not in ("model.embed_tokens.weight", "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((start / "config.json").read_text())
    config["pard_token"] = cfg.pard_token
    config["specd_drafter"] = {**config.get("specd_drafter", {}), "parallel_drafts": cfg.drafts}
    config.pop("_name_or_path", None)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in ("generation_config.json", "draft_vocab.json"):
        if (start / name).resolve() != (out / name).resolve():
            shutil.copyfile(start / name, out / name)


def measure_draft_cost(target_dir: Path, drafter_dir: Path, k: int, threads: int = 1, dtype: str = "bfloat16",
                       steps: int = 48) -> dict:
    """What a k-token draft costs against a target decode step, on our engine, batch 1, side by side:
    the drafter's propose call (catch-up of 2 committed tokens + the draft), one forward per token
    (sequential: the weights without pard_token) and, for a drafter with pard_token, in one forward
    (parallel)."""
    import shutil
    import tempfile

    import torch

    from specd import LLM, SamplingParams
    from specd.proposers.base import ProposeRequest
    from specd.proposers.draft_model import DraftModelProposer

    torch.set_num_threads(threads)
    history = list(range(1000, 1200))
    out = {"k": k, "threads": threads, "dtype": dtype}
    with tempfile.TemporaryDirectory() as tmp:
        sequential = Path(tmp) / "sequential"
        shutil.copytree(drafter_dir, sequential)
        config = json.loads((sequential / "config.json").read_text())
        modes = {"parallel": drafter_dir} if config.pop("pard_token", None) is not None else {}
        (sequential / "config.json").write_text(json.dumps(config))
        for mode, path in {**modes, "sequential": sequential}.items():
            proposer = DraftModelProposer(str(path), dtype=dtype)
            seq = list(history)
            proposer.propose([ProposeRequest(seq_id=0, new_tokens=seq, num_tokens=len(seq), k=k, full_history=True)])
            times = []
            for i in range(steps):
                seq += [1100 + i % 50, 1150 + i % 40]
                t0 = time.perf_counter()
                proposer.propose([ProposeRequest(seq_id=0, new_tokens=seq[-2:], num_tokens=len(seq), k=k)])
                times.append(time.perf_counter() - t0)
            out[f"{mode}_draft_ms"] = 1e3 * sorted(times)[len(times) // 2]
    llm = LLM(str(target_dir), dtype=dtype)
    out["dtype"] = str(llm.engine.dtype).removeprefix("torch.")  # what "auto" resolved to
    prompt = [{"prompt_token_ids": history}]
    llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0))  # warm-up
    t0 = time.perf_counter()
    llm.generate(prompt, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    out["target_step_ms"] = (time.perf_counter() - t0) / 64 * 1e3
    for mode in (*modes, "sequential"):
        out[f"{mode}_share"] = out[f"{mode}_draft_ms"] / out["target_step_ms"]
    return out


def write_card(out: Path, report: dict, command: str) -> None:
    train, cfg, data = report["train"], report["train"]["config"], report["train"]["data"]
    cost, m = report["cost"], report["machine"]
    precision = train.get("precision", "float32 (no native bf16 matmul)")  # (runs before it recorded it: float32)
    k = cfg["drafts"]
    lines = [
        "# SmolLM2-135M-Instruct-drafter",
        "",
        "specd's draft model for SmolLM2-135M-Instruct (the default target), a parallel drafter (PARD, "
        "Chen et al. 2025): 2 Llama decoder layers and a final norm over the target's own token embeddings "
        "(shared, frozen; tied output head scoring a draft vocabulary of "
        f"{len(json.loads((out / 'draft_vocab.json').read_text())['ids'])} ids, `draft_vocab.json`). "
        f"Fed the committed tokens and {k - 1} copies of `pard_token` ({cfg['pard_token']}, `<empty_output>`), "
        f"one forward drafts {k} tokens: the last real row gives draft 1, mask j gives draft j + 1. "
        "The layout is a plain Llama directory with `pard_token` in config.json, the key vLLM's parallel "
        "drafting reads; `specd_drafter.parallel_drafts` says how many drafts it was trained for. "
        "Verification is unchanged, so output stays exactly the target's.",
        "",
        "Only the trained parts are committed (`model.safetensors`, bfloat16); `specd models fetch` adds the "
        "target's embeddings and tokenizer to make a complete Hugging Face directory in the cache.",
        "",
        "## Data and objective",
        "",
        f"Start: the autoregressive drafter `specd train-drafter` makes (2 layers from the target's layers 0 and 1, "
        "distilled on 819,533 tokens of the target's answers). Then parallel training on the `specd drafter-data` "
        f"shards: {train['conversations']:,} conversations of {data['shards']} shards "
        f"({train['tokens']:,} tokens of prompt + answer; {cfg['max_len']} at most per conversation), the target's own "
        "answers to questions it asked itself (3 in 4) and to built prompts, 2 of 3 greedy, 1 of 3 at T = 0.7. "
        f"Making them took {data['seconds'] / 3600:.2f} h here ({data['generated_tokens']:,} generated tokens, "
        f"{train['data_tokens_per_s']:.0f} tok/s at batch 128; the run resumes where it stopped).",
        f"Rows: every real token (the autoregressive objective) and mask groups 1..{k - 1} at a share "
        f"{cfg['keep'][1:]} of answer anchors (PARD's conditional drop-token); cross-entropy to the data's next "
        f"token on the draft vocabulary, weight 1 on answers, {cfg['prompt_weight']} on prompts. AdamW, lr "
        f"{cfg['lr']} (warmup {cfg['warmup']}, cosine to 10%), {cfg['epochs']} epoch(s), ~{cfg['batch_rows']} rows "
        f"per batch ({train['steps']} steps, {train['rows']:,} rows), {precision} on this CPU; "
        f"{train['wall_s'] / 60:.1f} min of training, {train['wall_s_total'] / 60:.1f} min for the whole run.",
        "",
        f"## Held-out acceptance (greedy, k = {k})",
        "",
        "The target's own greedy answers (float32) to prompts nothing was trained on "
        "(`training/specd_train/workloads.py`), replayed through speculative steps: alpha_j is the rate at "
        "which draft j is accepted given drafts 1..j-1 were; tokens/step counts the target's own token. "
        "Parallel: one forward per step, as served; sequential: the same weights drafting one forward per "
        "token (how the autoregressive drafter is served).",
        "",
        "| workload | drafter | mode | " + " | ".join(f"alpha_{j + 1}" for j in range(k)) + " | tokens/step |",
        "|---|---|---|" + "---|" * (k + 1),
    ]
    for name in report["heldout"]:
        for label, key in (("before (autoregressive)", "heldout_before"), ("this one", "heldout")):
            for mode in ("sequential", "parallel"):
                a = report[key][name][mode]
                lines.append(f"| {name} | {label} | {mode} | " + " | ".join(f"{x:.3f}" for x in a["alpha_per_position"])
                             + f" | {a['tokens_per_step']:.2f} |")
    lines += [
        "",
        "## Cost",
        "",
        f"On specd's engine, batch 1, {cost['dtype']}, {cost['threads']} thread, measured side by side: a "
        f"{k}-token draft (the propose call, with a 2-token catch-up) costs {cost['parallel_draft_ms']:.1f} ms in one "
        f"forward and {cost['sequential_draft_ms']:.1f} ms one forward per token; a target decode step "
        f"{cost['target_step_ms']:.1f} ms. Share of a target step: **{cost['parallel_share']:.3f}** parallel, "
        f"{cost['sequential_share']:.3f} sequential.",
        "",
        "## Reproduce",
        "",
        f"`specd drafter-data --shards {data['shards']} --batch 128 --threads 2` (resumable), then `{command}` "
        "(deterministic for the same machine, thread count and library versions).",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['threads']} torch threads; Python {m['python']}, "
        f"torch {m['torch']}. Date: {m['date']}.",
        "",
        "License: Apache-2.0, as the target (SmolLM2-135M-Instruct, Hugging Face).",
    ]
    (out / "README.md").write_text("\n".join(lines) + "\n")
