"""`specd demo-models`: verify and show the committed demo pair, or retrain it.

Wired into specd/cli/__init__.py through `add_arguments(parser)` and `run(args) -> int`; also runnable
as `python -m specd_train.demo.command` (used to launch long retrains in the background).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

# Names only: importing specd_train.demo.models would pull in transformers (a dev extra) for
# every `specd` command, since the CLI builds this subcommand's parser up front.
from specd.models.demo_paths import DEMO_NAMES, models_root

TARGET_NAME, DRAFTER_NAME = DEMO_NAMES["target"], DEMO_NAMES["drafter"]
HELP = "check (or --retrain) the bundled demo target/drafter pair"


def default_models_dir() -> Path:
    return models_root()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--retrain", action="store_true",
                        help="train tokenizer, target and drafter from scratch (about an hour on 2 CPU cores)")
    parser.add_argument("--out", type=Path, default=None,
                        help="models folder (default: $SPECD_MODELS_DIR or the repository's models/)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    # Default 1, the committed run's setting: weights depend on the thread count, and on a
    # shared 2-core machine 2 threads stall (7-11 s a step vs 2.2 s) whenever a neighbour runs.
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads; fixed for determinism (default 1, as the committed run)")
    parser.add_argument("--smoke", action="store_true",
                        help="with --retrain: tiny models, a corpus slice and a few steps (seconds)")
    parser.add_argument("--target-steps", type=int, default=None, help="override the target's step budget")
    parser.add_argument("--drafter-steps", type=int, default=None, help="override the drafter's step budget")
    parser.add_argument("--reuse-target", type=Path, default=None,
                        help="with --retrain: take the target of an earlier run's models folder (same settings) "
                             "and train only the drafter; gives the same weights as a full run")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else default_models_dir()
    if args.retrain:
        return _retrain(args, out)
    from specd_train.demo.checksums import verify_checksums

    n = verify_checksums(out)
    for name in (TARGET_NAME, DRAFTER_NAME):
        card = out / name / "README.md"
        if not card.is_file():
            raise FileNotFoundError(f"model card {card} not found")
        print(card.read_text(encoding="utf-8"))
    print(f"checksums OK: {n} files in {out}")
    return 0


def _retrain(args: argparse.Namespace, out: Path) -> int:
    import torch

    from specd_train.demo.pipeline import FULL, SMOKE, build_pair

    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    spec = SMOKE if args.smoke else FULL
    for field, value in (("target_steps", args.target_steps), ("drafter_steps", args.drafter_steps)):
        if value is not None:
            if value < 1:
                raise ValueError(f"--{field.replace('_', '-')} must be >= 1, got {value}")
            spec = replace(spec, **{field: value})
    report = build_pair(spec, out, device=args.device, threads=args.threads, reuse_target=args.reuse_target)
    e = report["eval"]
    print(f"wrote {out / TARGET_NAME} and {out / DRAFTER_NAME} in {report['wall_s'] / 60:.1f} min: "
          f"held-out loss target {e['target_loss']:.3f}, drafter {e['drafter_loss']:.3f}; "
          f"alpha(k=4) {e['alpha_k4']:.3f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specd demo-models", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
