"""The fuzz tests' properties with a larger budget: the longer run issue 70 asks for beside CI's.

    python bench/fuzz.py                                   # 2,000 examples a property, a fresh seed
    python bench/fuzz.py --examples 10000 --only grpc      # longer, the gRPC properties only
    python bench/fuzz.py --seed 1234                       # again, exactly as a run that printed seed 1234
    python bench/fuzz.py --out bench/results/fuzz_xeon     # also a record: .json and .md

tests/services/test_fuzz_http.py and test_fuzz_grpc.py run each property for 150 examples in CI,
derandomized (the same examples every run). Here SPECD_FUZZ_EXAMPLES raises the budget
(tests/services/fuzzing.py reads it) and the examples come from hypothesis' seed, drawn here unless
given and printed first, so a failure found in a long run is reproduced by running it again with
its seed; hypothesis also prints the failing example and a @reproduce_failure blob. What fails is a
finding: fix the server, and add the shrunk example as a plain test beside the properties. The same
processes as in CI (a gateway, a verifier on the demo target, ngram and suffix drafters), on one
torch thread each; about 0.1 s an example on 2 cores.
"""
from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = {"http": "tests/services/test_fuzz_http.py", "grpc": "tests/services/test_fuzz_grpc.py"}


def run(args) -> dict:
    env = dict(os.environ, SPECD_FUZZ_EXAMPLES=str(args.examples), OMP_NUM_THREADS="1")
    rows = []
    for name in (args.only,) if args.only else FILES:
        cmd = [sys.executable, "-m", "pytest", FILES[name], "-q", "-p", "no:cacheprovider", "--timeout", "0",
               f"--hypothesis-seed={args.seed}", "-k", "generated"]
        if args.statistics:
            cmd.append("--hypothesis-show-statistics")
        print("$", " ".join(cmd), flush=True)
        t0 = time.monotonic()
        rc = subprocess.call(cmd, cwd=ROOT, env=env)
        rows.append({"file": FILES[name], "passed": rc == 0, "exit_code": rc, "minutes": (time.monotonic() - t0) / 60})
    return {"rows": rows}


def render(r: dict) -> str:
    s = r["settings"]
    lines = [f"# Fuzz: {s['examples']} examples a property, seed {s['seed']}", "",
             "| file | result | minutes |", "|---|---|---|"]
    for row in r["rows"]:
        result = "passed" if row["passed"] else f"FAILED (exit {row['exit_code']})"
        lines.append(f"| {row['file']} | {result} | {row['minutes']:.1f} |")
    from machine import machine_line

    return "\n".join([*lines, "", f"`{r['command']}`", "", machine_line(r), ""])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=2000, help="examples a property (CI: 150)")
    p.add_argument("--seed", type=int, default=None, help="hypothesis' seed (default: a fresh one, printed)")
    p.add_argument("--only", choices=sorted(FILES), default=None, help="one interface's properties")
    p.add_argument("--statistics", action="store_true", help="hypothesis' statistics: what each property's "
                                                             "examples were answered (slower)")
    p.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    args = p.parse_args()
    args.seed = random.randrange(2 ** 32) if args.seed is None else args.seed
    print(f"seed {args.seed}: run again with --seed {args.seed} --examples {args.examples}", flush=True)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import machine_info, write_result

    info, t0 = machine_info(threads=1), time.monotonic()
    result = run(args)
    if args.out is not None:
        write_result(args.out, "bench/fuzz.py", None, info, {"examples": args.examples, "seed": args.seed},
                     result["rows"], t0, render)
    print(f"seed {args.seed}: {'all passed' if all(r['passed'] for r in result['rows']) else 'FAILED'}")
    return 0 if all(r["passed"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
