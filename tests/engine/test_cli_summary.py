"""`specd generate` prints one summary line on stderr after the JSON lines: prompts, generated
tokens, wall seconds, tokens/s and, with speculation, the summed counters. stdout stays
exactly the JSON lines.

Real subprocesses of the CLI on the bundled demo target, both runs launched at once.
"""
from __future__ import annotations

import json
import re
import subprocess

import pytest

from specd.models.demo_paths import demo_model_dir

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not (demo_model_dir("target") / "config.json").is_file(),
                                 reason="the bundled demo target is missing")]

PROMPTS = [{"prompt": "def fibonacci(n):\n    "}, {"prompt": "import os\nimport sys\n\n"},
           {"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7, 8]}]
# adaptive off: on a loaded machine the controller may rightly turn speculation off, and this
# test is about the counters, not that decision.
NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "adaptive": false}'
SPEC_KEYS = ("drafts", "draft_tokens", "accepted_tokens", "acceptance_rate", "mean_acceptance_length")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, specd_cli, cli_env):
    f = tmp_path_factory.mktemp("summary") / "prompts.jsonl"
    f.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    argv = specd_cli + ["generate", "--model", str(demo_model_dir("target")), "--prompts-file", str(f),
                        "--max-tokens", "24", "--temperature", "0", "--ignore-eos", "--threads", "1"]
    procs = {"plain": subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env),
             "ngram": subprocess.Popen(argv + ["--speculative-config", NGRAM], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, env=cli_env)}
    out = {}
    for name, p in procs.items():
        try:
            stdout, stderr = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
        out[name] = (p.returncode, stdout, stderr)
    return out


def _parse(run) -> tuple[list[dict], dict[str, str]]:
    """The JSON rows of stdout (every line must be one) and the summary's key=value fields."""
    rc, stdout, stderr = run
    assert rc == 0, stderr[-3000:]
    lines = stdout.splitlines()
    assert lines and all(line.strip() for line in lines), stdout
    rows = [json.loads(line) for line in lines]
    summaries = [line for line in stderr.splitlines() if line.startswith("summary:")]
    assert len(summaries) == 1, stderr
    assert stderr.rstrip().splitlines()[-1] == summaries[0], "the summary is the last line on stderr"
    fields = dict(re.findall(r"(\w+)=(\S+)", summaries[0]))
    return rows, fields


def test_summary_counts_the_tokens_on_stdout(runs):
    rows, fields = _parse(runs["plain"])
    assert [r["index"] for r in rows] == list(range(len(PROMPTS)))
    tokens = sum(len(r["token_ids"]) for r in rows)
    assert tokens == 24 * len(PROMPTS)  # --ignore-eos: every prompt runs to max_tokens
    assert int(fields["prompts"]) == len(PROMPTS)
    assert int(fields["generated_tokens"]) == tokens
    wall = float(fields["wall_s"])
    assert wall > 0
    assert float(fields["tokens_per_s"]) == pytest.approx(tokens / wall, rel=0.01, abs=0.1)
    assert not set(SPEC_KEYS) & fields.keys(), "no speculation counters without speculation"
    assert all("spec" not in r for r in rows)


def test_summary_speculation_counters_are_the_sums_of_the_rows(runs):
    rows, fields = _parse(runs["ngram"])
    plain_rows, _ = _parse(runs["plain"])
    # greedy speculation is lossless: the same tokens as without it
    assert [r["token_ids"] for r in rows] == [r["token_ids"] for r in plain_rows]
    assert int(fields["generated_tokens"]) == sum(len(r["token_ids"]) for r in rows)
    totals = {k: sum(r["spec"][k] for r in rows) for k in ("drafts", "draft_tokens", "accepted_tokens")}
    assert totals["drafts"] > 0, "the prompts should give ngram something to draft"
    for key, total in totals.items():
        assert int(fields[key]) == total, key
    assert float(fields["acceptance_rate"]) == pytest.approx(totals["accepted_tokens"] / totals["draft_tokens"],
                                                             abs=5e-4)
    assert float(fields["mean_acceptance_length"]) == pytest.approx(
        1 + totals["accepted_tokens"] / totals["drafts"], abs=5e-4)
