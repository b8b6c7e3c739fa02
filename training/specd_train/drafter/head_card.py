"""The last steps every head trainer shares (eagle3, medusa, mlp_speculator): save with the
target's fingerprint, held-out acceptance through the serving proposer, the draft's cost next
to the target's, eval.json and the card (README.md)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from specd_train.drafter import head_training as ht
from specd_train.drafter import precision

_ABOUT = {
    "eagle3": (
        "An EAGLE-3 head for SmolLM2-135M-Instruct (the default target), trained by specd: `fc` over three of the "
        "target's layers side by side (the inputs of layers {layers}), one decoder layer whose attention reads "
        "[norm(token embedding), norm(fc output)] (2 x hidden wide), and its own LM head over a draft vocabulary "
        "(`d2t`). Saved in the yuhuili/EAGLE3 layout (`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`) that "
        "specd, vLLM and SGLang load; the token embeddings are the target's, taken from its files.",
        "EAGLE-3's training-time test: the head runs {ttt} steps on each batch, every step after the first reading "
        "the head's own outputs where serving will (a query at step s sees the target-fed pairs up to j - s and "
        "its own chain), teacher-forced on the answer tokens; loss: cross-entropy to the target's distribution "
        "over the draft vocabulary at every step, equally weighted (no feature regression)."),
    "medusa": (
        "Medusa heads for SmolLM2-135M-Instruct (the default target), trained by specd: {heads} heads, each a "
        "ResBlock (x + SiLU(W x + b), started at the identity) on the target's final normed state, then the "
        "target's own LM head, frozen and restricted to a draft vocabulary. Head a drafts the token a + 1 places "
        "after the target's next one; all heads run in one pass (parallel drafting). Saved in Medusa's layout "
        "(`medusa_lm_head.safetensors`, `{{a}}.0.linear.*`) without the output layers: `specd_lm_head: \"target\"` "
        "and `d2t` in the checkpoint tell specd's loader to use those rows of the target's LM head.",
        "Medusa-1 self-distillation: the target frozen; head a's cross-entropy to the target's distribution at "
        "j+1+a over the draft vocabulary, weighted 0.8^a."),
    "mlp_speculator": (
        "An MLP speculator (IBM's design) for SmolLM2-135M-Instruct (the default target), trained by specd: "
        "{stages} stages, each state <- GELU(LN(proj(state) + c * embedding(last token))) and logits from the "
        "state; stage 0 starts from the target's final normed state, each stage reads the previous one's token. "
        "The token embeddings and the output layer are the target's own, frozen (the output restricted to a draft "
        "vocabulary); only `proj.*` and `ln.*` are trained and stored, in IBM's layout, with `specd_embeddings` "
        "/ `specd_lm_head: \"target\"` and `d2t` telling specd's loader where the rest comes from.",
        "IBM's stage-1 recipe on the target's own answers: teacher-forced (stage a reads the answer's token), "
        "stage a's cross-entropy to the target's distribution at j+1+a over the draft vocabulary, weighted 0.8^a."),
}


def measure_cost(target_dir: Path, head_dir: Path, tokens: int = 64, k: int = 4, threads: int = 1,
                 method: str = "eagle") -> dict:
    """Draft time per token (the serving proposer, one sequence, k drafts after a one-token
    delta, as in steady decoding) against the target's decode time per token on our engine,
    batch 1, float32, the same thread count, measured side by side."""
    from specd import LLM, SamplingParams
    from specd.proposers.base import ProposeRequest
    from specd.proposers.hidden_state import HiddenStateProposer

    torch.set_num_threads(threads)
    llm = LLM(str(target_dir), dtype="float32")
    prompt = [{"prompt_token_ids": list(range(1000, 1200))}]
    llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0))  # warm-up
    t0 = time.perf_counter()
    llm.generate(prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    target_ms = (time.perf_counter() - t0) / tokens * 1e3
    del llm
    proposer = HiddenStateProposer(method, str(head_dir), str(target_dir), num_speculative_tokens=k,
                                   dtype="float32", device="cpu")
    width = proposer.hidden_size * len(proposer.feature_layers)
    gen = torch.Generator().manual_seed(0)
    ids = list(range(1000, 1200))
    proposer.propose([ProposeRequest(seq_id=0, new_tokens=ids, num_tokens=len(ids), k=k, full_history=True,
                                     features=torch.randn(len(ids) - 1, width, generator=gen),
                                     feature_layers=proposer.feature_layers)])
    t0 = time.perf_counter()
    for i in range(tokens // k):
        ids.append(1000 + i)
        proposer.propose([ProposeRequest(seq_id=0, new_tokens=ids[-1:], num_tokens=len(ids), k=k,
                                         features=torch.randn(1, width, generator=gen),
                                         feature_layers=proposer.feature_layers)])
    draft_ms = (time.perf_counter() - t0) / (tokens // k * k) * 1e3
    return {"draft_ms_per_token": draft_ms, "target_ms_per_token": target_ms, "ratio": draft_ms / target_ms,
            "k": k, "threads": threads}


def lm_rows(target_dir: Path, draft_ids: torch.Tensor | None) -> torch.Tensor:
    """The target's LM head, float32, restricted to the draft vocabulary when there is one."""
    from specd.proposers.heads.checkpoint import load_target_pieces

    head = load_target_pieces(str(target_dir), embed=False, lm_head=True).lm_head.float()
    return head if draft_ids is None else head[draft_ids]


def finish_head(method: str, target_dir: Path, out: Path, args, data: dict, report: dict, cfg, t0: float,
                save, log=print) -> dict:
    """save(fingerprint) writes the checkpoint; then held-out acceptance, cost, eval.json, card."""
    from dataclasses import asdict

    from specd.engine.loader import load_model, read_arch_config
    from specd.proposers.hidden_state import HiddenStateProposer
    from specd_train.drafter.card import machine

    arch = read_arch_config(target_dir)
    save(load_model(target_dir, arch, torch.float32, torch.device("cpu"), 64, False).fingerprint)
    proposer = HiddenStateProposer(method, str(out), str(target_dir), num_speculative_tokens=8, dtype="float32",
                                   device="cpu")
    ks = [k for k in (1, 2, 4, 6) if k <= proposer.max_k]
    evals = {}
    for name, (seqs, feats, pls) in data["heldout"].items():
        rows = ht.columns(feats, data["layers"], proposer.feature_layers, arch.hidden_size)
        evals[name] = {k: ht.acceptance(proposer, seqs, rows, pls, k) for k in ks}
    params = sum(int(t.numel()) for t in _tensors(out).values())
    result = {"method": method, "config": asdict(cfg), "feature_layers": list(proposer.feature_layers),
              "train": {**report, "prompts": len(data["prompts"]), "tokens": sum(len(s) for s in data["seqs"]),
                        "wall_s_total": time.perf_counter() - t0, "precision": precision.label()},
              "heldout": evals, "params_stored": params,
              "cost": measure_cost(target_dir, out, method=method), "machine": machine(args.threads)}
    (out / "eval.json").write_text(json.dumps(result, indent=1) + "\n")
    command = (f"specd train-drafter --method {method} --threads {args.threads} --prompts {args.prompts} "
               f"--questions {args.questions} --out {out}")
    write_card(out, result, command)
    for name, by_k in evals.items():
        a = by_k[max(ks)]
        log(f"{name}: k={max(ks)} alpha per position {[round(x, 3) for x in a['alpha_per_position']]}, "
            f"tokens/step {a['tokens_per_step']:.2f}")
    return result


def _tensors(out: Path) -> dict:
    from safetensors import safe_open

    found = {}
    for file in out.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            found.update({k: f.get_tensor(k) for k in f.keys() if k not in ("d2t", "t2d")})
    return found


def write_card(out: Path, r: dict, command: str) -> None:
    cfg, train, cost, m = r["config"], r["train"], r["cost"], r["machine"]
    about, objective = _ABOUT[r["method"]]
    about = about.format(layers=", ".join(map(str, r["feature_layers"])), ttt=cfg.get("ttt_steps"),
                         heads=cfg.get("num_heads"), stages=cfg.get("n_predict"))
    objective = objective.format(ttt=cfg.get("ttt_steps"))
    lines = [f"# {out.name}", "", about, "",
             f"Stored: {r['params_stored']:,} parameters, bfloat16; a draft vocabulary of {cfg['draft_vocab']:,} "
             "ids, the most frequent in the training answers (the head never drafts another id; verification is "
             "unchanged, so output stays the target's). `config.json` records the target's weights fingerprint "
             "(`specd_target_fingerprint`): a verifier serving other weights refuses the head.", "",
             "## Data and objective", "",
             f"{train['prompts']} training chat prompts (the draft_model recipe's: stdlib-built prompts and everyday "
             f"questions) with the target's own answers ({train['tokens']:,} tokens of prompt + answer, cached by "
             "`specd train-drafter`), and the target's hidden states at every position (transformers, bfloat16). "
             f"{objective} Answer positions weigh 1, prompt positions {cfg['prompt_weight']}. AdamW, lr {cfg['lr']} "
             f"(warmup {cfg['warmup']}, cosine to 10%), {cfg['epochs']} epochs of batches of ~{cfg['batch_tokens']} "
             f"tokens ({train['steps']} steps), {train.get('precision', 'bf16 autocast')}; "
             f"{train['wall_s'] / 60:.1f} min of training, "
             f"{train['wall_s_total'] / 60:.1f} min for the whole run.", "",
             "| epoch | loss | top-1 agreement with the target (first draft, teacher-forced) |", "|---:|---:|---:|"]
    lines += [f"| {i + 1} | {e['loss']:.4f} | {e['top1_agreement']:.3f} |" for i, e in enumerate(train["epochs"])]
    lines += ["", "## Held-out acceptance (greedy)", "",
              "The target's own greedy answers (float32) to prompts nothing was trained on (`training/specd_train/workloads.py`), "
              f"replayed through the serving `{r['method']}` proposer as the verifier drives it (each step sends the "
              "committed tokens and the target states that predicted them): alpha_j is the rate at which draft j is "
              "accepted given drafts 1..j-1 were; tokens/step counts the target's own token too.", "",
              "| workload | k | alpha per position | alpha (all) | tokens/step |", "|---|---:|---|---:|---:|"]
    for name, by_k in r["heldout"].items():
        for k, a in by_k.items():
            lines.append(f"| {name} | {k} | {' / '.join(f'{x:.2f}' for x in a['alpha_per_position'])} | "
                         f"{a['alpha']:.3f} | {a['tokens_per_step']:.2f} |")
    lines += ["", "## Cost", "",
              f"On specd's engine and the serving proposer, batch 1, float32, {cost['threads']} thread, measured side "
              f"by side: a drafted token (k = {cost['k']} per step) {cost['draft_ms_per_token']:.2f} ms, a target "
              f"decode step {cost['target_ms_per_token']:.1f} ms: ratio **{cost['ratio']:.3f}**.", "",
              "## Reproduce", "", f"`{command}` (needs the dev extras; deterministic on the same machine, thread count "
              "and library versions; the answers and features come from the cache when present).", "",
              f"Machine: {m['cpu']}, {m['cores']} cores, {m['threads']} torch threads; Python {m['python']}, torch "
              f"{m['torch']}. Date: {m['date']}.", "",
              "License: Apache-2.0, as the target (SmolLM2-135M-Instruct, Hugging Face).", ""]
    (out / "README.md").write_text("\n".join(lines))
