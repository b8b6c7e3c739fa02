"""Model cards (README.md) for the demo pair, written from the report after training."""

from __future__ import annotations

import os
import platform

import tokenizers
import torch
import transformers

DETERMINISM = (
    "Training is deterministic: fixed seeds, sorted file order, data windows drawn from a "
    "seeded generator, step-budgeted schedules, `torch.use_deterministic_algorithms(True)` and "
    "a fixed thread count. Retraining with the same command on the same machine (same CPU, "
    "thread count, Python, torch and tokenizers versions) gives byte-identical weights and "
    "tokenizer; a different CPU, thread count or library version changes float reduction "
    "order and therefore the weights, though not the quality."
)


def machine_info(device: str, threads: int) -> dict:
    cpu = "unknown"
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "threads": threads, "device": device,
            "os": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__}
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _common(r: dict, role: str) -> list[str]:
    d, m, e = r["data"], r["machine"], r["eval"]
    me = r[role]
    s, p, t = me["size"], me["params"], me["train"]
    spec = r["spec"]
    lines = [
        "## Architecture",
        "",
        f"Llama (`LlamaForCausalLM`), hidden {s['hidden']}, {s['layers']} layers, {s['heads']} heads, "
        f"{s['kv_heads']} KV heads (GQA, head_dim {s['hidden'] // s['heads']}), MLP {s['intermediate']} (SiLU), "
        f"RoPE theta 10000, max positions 1024, tied input/output embeddings, vocabulary {d['vocab_size']}.",
        f"Parameters: {p['total']:,} total, {p['non_embedding']:,} non-embedding. "
        f"The target has {r['ratio_non_embedding']:.1f}x the drafter's non-embedding parameters.",
        "Weights: safetensors, bfloat16 (trained in float32). Tokenizer: byte-level BPE shared by both "
        "models, special tokens `<|bos|>` `<|eos|>` `<|pad|>` `<|im_start|>` `<|im_end|>`, BOS added on encode.",
        "",
        "## Data",
        "",
        f"The Python standard library of CPython {d['python']} (`{d['stdlib']}`), *.py files in sorted "
        f"order, test packages, idlelib, lib2to3, encodings and pydoc_data skipped: {d['train_files']} training "
        f"files, {d['train_tokens']:,} tokens. Held out (never trained on, tokenizer included): "
        f"{d['heldout_files']} files, {d['heldout_tokens']:,} tokens, modules "
        + ", ".join(f"`{x}`" for x in d["heldout_modules"]) + ".",
        "",
        "## Training",
        "",
        f"{t['steps']:,} steps of {t['batch']} x {t['context']} tokens ({t['tokens']:,} tokens), AdamW "
        f"(betas 0.9/0.95, weight decay 0.1), peak lr {t['lr']}, {t['warmup']} warmup steps then cosine to 10%, "
        f"grad clip 1.0. Wall time {t['wall_s'] / 60:.1f} min ({t['tokens_per_s']:,.0f} tokens/s); "
        + _whole_run(r),
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['threads']} torch thread(s), device {m['device']}"
        + (f" ({m['gpu']})" if "gpu" in m else "")
        + f"; Python {m['python']}, torch {m['torch']}, transformers {m['transformers']}, "
        f"tokenizers {m['tokenizers']}.",
        f"Reproduce: `specd demo-models --retrain --threads {m['threads']} --device {m['device']}`.",
        "",
        DETERMINISM,
        "",
        "## Held-out loss",
        "",
        f"Cross entropy per token on {e['loss_windows']} held-out windows of {spec['context']} tokens "
        "(bf16 weights computed in float32):",
        "",
        "| model | loss (nats/token) |",
        "|---|---|",
        f"| target | {e['target_loss']:.4f} |",
        f"| drafter | {e['drafter_loss']:.4f} |",
        "",
    ]
    return lines


def acceptance_section(r: dict) -> list[str]:
    e, spec = r["eval"], r["spec"]
    acc = e["acceptance"]
    ks = sorted(acc, key=int)
    width = max(len(acc[k]["per_position"]) for k in ks)
    lines = [
        "## Greedy acceptance, drafter vs target",
        "",
        f"Greedy speculative decoding on {spec['eval_prompts']} held-out prompts of {spec['eval_prompt_len']} "
        f"tokens, {spec['eval_gen_len']} generated tokens each. Position i: P(draft i accepted | drafts < i "
        "accepted). alpha: accepted / drafted tokens. tokens/pass: mean tokens emitted per target pass.",
        "",
        "| k | " + " | ".join(f"pos {i + 1}" for i in range(width)) + " | alpha | tokens/pass |",
        "|---|" + "---|" * (width + 2),
    ]
    for k in ks:
        a = acc[k]
        cells = [f"{x:.3f}" for x in a["per_position"]] + [""] * (width - len(a["per_position"]))
        lines.append(f"| {k} | " + " | ".join(cells) + f" | {a['alpha']:.3f} | {a['tokens_per_step']:.2f} |")
    lines += ["", f"**alpha at k = 4: {e['alpha_k4']:.3f}** (on prompts[::{spec['slice_stride']}], as the "
              f"test re-measures it: {e['alpha_k4_slice']:.3f}). Numbers in `specd-demo-drafter/eval.json`.", ""]
    return lines


def _whole_run(r: dict) -> str:
    tt = r["target"]["train"]
    if "reused_from" not in tt:
        return f"whole run including the other model and evaluation {r['wall_s'] / 60:.1f} min."
    # --reuse-target: this run trained only the drafter; a full retrain adds the target's time.
    return (f"the target was taken from an earlier run with the same settings (`--reuse-target`), this run "
            f"(drafter and evaluation) took {r['wall_s'] / 60:.1f} min, so a full retrain takes about "
            f"{(tt['wall_s'] + r['wall_s']) / 60:.0f} min.")


def _sample(r: dict) -> list[str]:
    return ["## Sample", "", f"The target's greedy continuation of `{r['spec']['sample_prompt']!r}`:",
            "", "```python", r["eval"]["sample"], "```", ""]


def target_card(r: dict) -> str:
    head = ["# specd-demo-target", "",
            "The target model of specd's demo pair: a small Llama trained from scratch on Python code, "
            "shipped so specd runs offline with a real target/drafter pair. Not useful for anything else.", ""]
    return "\n".join(head + _common(r, "target") + acceptance_section(r) + _sample(r))


def drafter_card(r: dict) -> str:
    spec = r["spec"]
    w, rows = spec.get("argmax_weight", 0.0), spec.get("greedy_rows", 0)
    hard = f", plus {w:g} x cross-entropy on the target's greedy token" if w else ""
    text = (f" {spec['greedy_share']:.0%} of each batch are windows of {spec['greedy_prompt']} corpus tokens "
            f"followed by the target's own greedy continuation (a pool of {rows}), the kind of text the "
            "drafter is verified on; the rest are corpus windows.") if rows else ""
    head = ["# specd-demo-drafter", "",
            "The drafter of specd's demo pair, distilled from `specd-demo-target` (KL divergence to the "
            f"frozen target's logits at temperature 1{hard}) so that its greedy drafts agree with the target."
            + text, ""]
    return "\n".join(head + _common(r, "drafter") + acceptance_section(r))
