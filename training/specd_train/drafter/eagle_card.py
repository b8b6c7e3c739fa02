"""The EAGLE head's card (README.md) and its cost next to the target's, from eval.json."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from specd_train.drafter.head_card import measure_cost


def write_card(out: Path, report: dict, command: str) -> None:
    train, cfg, cost, m = report["train"], report["config"], report["cost"], report["machine"]
    params = report["params"]
    lines = [
        f"# {out.name}", "",
        "An EAGLE-1 head for SmolLM2-135M-Instruct (the default target), trained by specd: `fc` over the "
        "concatenation of a token's embedding and the target's final normed hidden state, then one Llama "
        "decoder layer (started from the target's last layer; no input norm, as in the yuhuili/EAGLE layout) "
        "whose output predicts the target's next hidden state; the target's own LM head turns it into draft "
        "logits. The embeddings and LM head are the target's and are not stored here: `specd drafter --method "
        "eagle --model DIR --target TARGET` takes them from the target.", "",
        f"Stored: `model.safetensors`, bfloat16, {params['trained']:,} parameters (fc {params['fc']:,}, "
        f"layer {params['layer']:,}). `config.json` records the target's weights fingerprint "
        f"(`specd_target_fingerprint`): a verifier serving other weights refuses the head."
        + (f" `d2t` (EAGLE-3's convention) names a draft vocabulary of {params['draft_vocab']:,} ids, the most "
           "frequent in the training answers: the head scores only those rows of the target's LM head, and "
           "never drafts another id (verification is unchanged, so output stays the target's)."
           if params.get("draft_vocab") else ""), "",
        "## Data and objective", "",
        f"The draft_model recipe's {train['prompts']} training prompts and the target's own answers to them "
        f"({train['tokens']:,} tokens of prompt + answer, cached from `specd train-drafter`). At every position "
        "the target's final normed state (transformers, bfloat16). Loss (EAGLE): smooth-L1 from the head's "
        f"output at pair j to the target's state at j+1, plus {cfg['cls_weight']} x cross-entropy to the "
        "target's distribution there; Gaussian noise on the input states (the head reads its own predictions "
        f"after the first draft); answer positions weigh 1, prompt positions {cfg['prompt_weight']}. AdamW, lr "
        f"{cfg['lr']} (warmup {cfg['warmup']}, cosine to 10%), {cfg['epochs']} epochs of batches of ~"
        f"{cfg['batch_tokens']} tokens ({train['steps']} steps), {train.get('precision', 'bf16 autocast')}; "
        f"{train['wall_s'] / 60:.1f} min of training, {train['wall_s_total'] / 60:.1f} min for the whole run "
        "(on a machine shared with other jobs).", "",
        "| epoch | loss | top-1 agreement with the target (teacher-forced) |", "|---:|---:|---:|"]
    lines += [f"| {i + 1} | {e['loss']:.4f} | {e['top1_agreement']:.3f} |" for i, e in enumerate(train["epochs"])]
    lines += ["", "## Held-out acceptance (greedy)", "",
              "The target's own greedy answers (float32) to prompts nothing was trained on (`training/specd_train/workloads.py`), "
              "replayed through the serving `eagle` proposer as the verifier drives it (after the prefill each step "
              "sends the committed tokens and the states that predicted them): alpha_j is the rate at which draft "
              "j is accepted given drafts 1..j-1 were; tokens/step counts the target's own token too.", "",
              "| workload | k | alpha per position | alpha (all) | tokens/step |", "|---|---:|---|---:|---:|"]
    for name, by_k in report["heldout"].items():
        for k, a in by_k.items():
            lines.append(f"| {name} | {k} | {' / '.join(f'{x:.2f}' for x in a['alpha_per_position'])} | "
                         f"{a['alpha']:.3f} | {a['tokens_per_step']:.2f} |")
    lines += ["", "## Cost", "",
              f"On specd's engine and the serving proposer, batch 1, float32, {cost['threads']} thread, measured "
              f"side by side: a drafted token (chains of k = {cost['k']}) {cost['draft_ms_per_token']:.1f} ms, a "
              f"target decode step {cost['target_ms_per_token']:.1f} ms: ratio **{cost['ratio']:.3f}**.", "",
              "## Reproduce", "", f"`{command}` (needs the dev extras; the answers come from the draft_model "
              "recipe's cache, or are generated first).", "",
              f"Machine: {m['cpu']}, {m['cores']} cores, {m['threads']} torch threads; Python {m['python']}, torch "
              f"{m['torch']}. Date: {m['date']}.", "",
              "License: Apache-2.0, as the target (SmolLM2-135M-Instruct, Hugging Face).", ""]
    (out / "README.md").write_text("\n".join(lines))


def finish(target_dir: Path, out: Path, threads: int, command: str) -> None:
    """Parameter counts, the cost and the card, added to eval.json."""
    from safetensors import safe_open

    from specd_train.drafter.card import machine

    report = json.loads((out / "eval.json").read_text())
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        sizes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    count = {k: int(torch.tensor(v).prod()) for k, v in sizes.items()}
    fc = sum(v for k, v in count.items() if k.startswith("fc."))
    layer = sum(v for k, v in count.items() if k.startswith("layers."))
    report["params"] = {"trained": fc + layer, "fc": fc, "layer": layer, "draft_vocab": count.get("d2t", 0)}
    report["cost"] = measure_cost(target_dir, out)
    report["machine"] = machine(threads)
    (out / "eval.json").write_text(json.dumps(report, indent=1) + "\n")
    write_card(out, report, command)
