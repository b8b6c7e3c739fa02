"""`specd train-drafter`: the deterministic retrain of the default pair's drafter.

    specd train-drafter --threads 2                      # -> models/SmolLM2-135M-Instruct-drafter
    specd train-drafter --target DIR --out DIR --prompts 200 --epochs 1   # a quick smoke run

Steps: training prompts -> the target's own answers (our engine) -> the target's top-k
distribution at every position (transformers, float32) -> distil -> evaluate acceptance on
the held-out workloads -> write the drafter's layers, config and card. Needs the dev extras
(transformers). The answers are cached under $SPECD_CACHE/train-drafter/, keyed by everything
that determines them, so a rerun skips straight to training.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, replace
from pathlib import Path

HELP = "train the draft model for a target by distillation (default: the default pair's drafter)"
# method -> (module, its whole-run function) for the heads on the target's hidden states
HEAD_TRAINERS = {"eagle3": ("specd_train.drafter.eagle3", "train_eagle3"),
                 "medusa": ("specd_train.drafter.medusa", "train_medusa"),
                 "mlp_speculator": ("specd_train.drafter.mlp_speculator", "train_mlp_speculator"),
                 "parallel": ("specd_train.drafter.parallel_run", "train_parallel")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", default="draft_model", choices=["draft_model", "eagle", *HEAD_TRAINERS],
                   help="what to train (draft_model: a few-layer model sharing the target's embeddings; "
                        "eagle, eagle3, medusa, mlp_speculator: a head on the target's hidden states, "
                        "written to --out; parallel: the committed drafter adapted to draft k tokens in one "
                        "forward, on the `specd drafter-data` shards)")
    p.add_argument("--target", default=None, help="target model directory (default: the fetched default target)")
    p.add_argument("--out", default=None, help="output directory (default: models/SmolLM2-135M-Instruct-drafter)")
    p.add_argument("--prompts", type=int, default=640,
                   help="training prompts built from the stdlib and topic lists (prompts.py) the target answers")
    p.add_argument("--questions", type=int, default=3720,
                   help="everyday chat questions (questions.py) the target answers as well")
    p.add_argument("--max-tokens", type=int, default=160, help="max tokens per answer")
    p.add_argument("--answer-dtype", default="bfloat16", help="dtype of the target while answering")
    p.add_argument("--layers", default="0,1", help="target layers the drafter's layers start from")
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--max-conversations", type=int, default=None,
                   help="parallel: train on the first N conversations of the drafter-data shards (default: all)")
    p.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts per workload")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--card-only", action="store_true",
                   help="only re-measure the cost and rewrite README.md from an existing eval.json in --out")


def run(args) -> int:
    from specd_train.demo.train import set_determinism
    from specd.models.model_store import committed_drafter_dir, fetch

    set_determinism(0, args.threads)
    target = Path(args.target) if args.target else fetch()[0]
    if args.method in HEAD_TRAINERS:
        import importlib

        if not args.out:
            raise SystemExit(f"--method {args.method} needs --out (the head's directory)")
        module, function = HEAD_TRAINERS[args.method]
        getattr(importlib.import_module(module), function)(target, Path(args.out), args)
        return 0
    if args.method == "eagle":
        from specd_train.drafter.eagle import train_eagle

        if not args.out:
            raise SystemExit("--method eagle needs --out (the head's directory)")
        if args.card_only:
            from specd_train.drafter.eagle_card import finish as finish_eagle

            finish_eagle(target, Path(args.out), args.threads, f"specd train-drafter --method eagle --threads "
                         f"{args.threads} --prompts {args.prompts} --questions {args.questions} --out {args.out}")
        else:
            train_eagle(target, Path(args.out), args)
        return 0
    out = Path(args.out) if args.out else committed_drafter_dir()
    if not args.card_only:
        train_drafter(target, out, _config(args), args)
    finish(target, out, args)
    return 0


def finish(target_dir: Path, out: Path, args) -> None:
    """Sizes, the side-by-side cost measurement and the card, from eval.json."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    from specd.models.model_store import _assemble_drafter
    from specd_train.drafter import card
    from specd_train.drafter.parallel_run import measure_draft_cost

    report = json.loads((out / "eval.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        full = Path(tmp) / "drafter"
        _assemble_drafter(target_dir, full, print, src=out)
        drafter = AutoModelForCausalLM.from_pretrained(full, dtype=torch.float32)
        target_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(target_dir).parameters())
        report["params"] = card.param_counts(drafter, report["train"]["config"]["draft_vocab"], target_params)
        report["cost"] = card.measure_cost(target_dir, full)
        # What serving pays: a 4-token draft (the propose call) against a target step, in the dtype
        # `auto` serves here (bf16 where the CPU has it), 1 thread each, side by side.
        report["draft_cost"] = measure_draft_cost(target_dir, full, k=4, dtype="auto")
    report["cost_measured"] = card.machine(1)  # where and when the costs were measured
    if not args.card_only or "machine" not in report:  # the training run's machine and date stay
        report["machine"] = card.machine(args.threads)
    with open(out / "eval.json", "w") as f:
        json.dump(report, f, indent=1)
    card.write_card(out, report, f"specd train-drafter --threads {args.threads}")
    print(f"card: {out / 'README.md'}")


def _config(args):
    from specd_train.drafter.distill import DistillConfig

    cfg = DistillConfig(layers=tuple(int(x) for x in args.layers.split(",")))
    return replace(cfg, epochs=args.epochs) if args.epochs else cfg


def train_drafter(target_dir: Path, out: Path, cfg, args, log=print) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from specd.models.chat import chat_prompt_ids
    from specd.models.model_store import target_embeddings
    from specd.models.tokenizer import Tokenizer
    from specd_train.drafter import distill, precision
    from specd_train.drafter.answers import cached_answers, training_answers
    from specd_train.workloads import WORKLOADS, workload

    t0 = time.perf_counter()
    tok = Tokenizer.from_dir(target_dir)
    prompts, sequences = training_answers(target_dir, args, log)
    prompt_lens = [len(chat_prompt_ids(tok, m)) for m in prompts]
    # bfloat16 teacher: on CPUs with bf16 matrix units it is several times faster than float32,
    # and its top-k differs from the float32 target's only in the last digits.
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).eval()
    examples = distill.teacher_topk(target, sequences, prompt_lens, cfg, log)
    heldout = {}
    for name in WORKLOADS:
        msgs = workload(name, args.eval_prompts)
        seqs = cached_answers(target_dir, msgs, args, log, greedy_only=True, dtype="float32")
        heldout[name] = distill.teacher_topk(target, seqs, [len(chat_prompt_ids(tok, m)) for m in msgs], cfg, log)
    drafter = distill.make_drafter(target, cfg.layers)
    drafter.model.embed_tokens.weight.data.copy_(target_embeddings(target_dir))  # exact, not bf16-rounded
    del target
    head = distill.SubsetHead(drafter, distill.choose_draft_vocab(examples, cfg.draft_vocab, drafter.config.vocab_size))
    train_report = distill.train(head, examples, cfg, log)
    # What ships is the bfloat16-rounded drafter: evaluate exactly that.
    for p in drafter.model.layers.parameters():
        p.data = p.data.to(torch.bfloat16).float()
    drafter.model.norm.weight.data = drafter.model.norm.weight.data.to(torch.bfloat16).float()
    evals = {name: {"acceptance": {k: distill.acceptance(head, ex, k) for k in (1, 2, 4, 6, 8)},
                    "loss": _heldout_loss(head, ex, cfg), "draft_vocab_coverage": _coverage(head, ex)}
             for name, ex in heldout.items()}
    _save(head, out, cfg)
    report = {"train": {**train_report, "config": asdict(cfg), "prompts": len(prompts), "questions": args.questions,
                        "tokens": sum(len(s) for s in sequences), "wall_s_total": time.perf_counter() - t0,
                        "precision": precision.label()},
              "heldout": evals}
    with open(out / "eval.json", "w") as f:
        json.dump(report, f, indent=1)
    log(f"wrote {out}")
    return report


def _heldout_loss(head, examples, cfg) -> float:
    """Cross-entropy against the teacher's top-k on answer tokens (lower is better)."""
    import torch

    from specd_train.drafter.distill import _loss

    with torch.inference_mode():
        return float(_loss(head, examples, replace(cfg, argmax_weight=0.0, prompt_weight=0.0)))


def _coverage(head, examples) -> float:
    """Share of the target's greedy answer tokens that the draft vocabulary holds."""
    answer = [e.ids[e.prompt_len:] for e in examples]
    total = sum(len(a) for a in answer)
    return sum(int((head.to_draft[a] >= 0).sum()) for a in answer) / max(1, total)


def _save(head, out: Path, cfg) -> None:
    drafter = head.drafter
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    # Only the drafter's own weights: the embeddings (and tied head) are the target's,
    # added back by `specd models fetch` (specd/models/model_store.py).
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in drafter.state_dict().items()
             if k not in ("model.embed_tokens.weight", "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = drafter.config.to_dict()
    config.update(torch_dtype="float32", architectures=["LlamaForCausalLM"],
                  specd_drafter={"shares_embeddings_with": "SmolLM2-135M-Instruct",
                                 "init_layers": list(cfg.layers)})
    config.pop("dtype", None)
    with open(out / "config.json", "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    drafter.generation_config.to_json_file(str(out / "generation_config.json"))
    with open(out / "draft_vocab.json", "w") as f:  # the engine's head covers only these ids
        json.dump({"ids": head.ids.tolist()}, f)
        f.write("\n")
