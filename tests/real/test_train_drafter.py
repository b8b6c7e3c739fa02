"""`specd train-drafter` is deterministic and its card says what it measured (a tiny run)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specd.models import model_store

pytestmark = pytest.mark.timeout(1200)
TINY = ["--prompts", "6", "--questions", "3", "--max-tokens", "8", "--epochs", "1", "--eval-prompts", "1", "--threads", "1"]


def _train(tmp_path, name: str):
    out = tmp_path / name
    env = {"SPECD_CACHE": str(tmp_path / f"cache-{name}"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "specd.cli", "train-drafter", "--target",
                           str(model_store.target_dir()), "--out", str(out), *TINY],
                          capture_output=True, text=True, env=env, timeout=1100)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_retrain_is_bit_identical_and_carded(tmp_path):
    model_store.fetch()
    a, b = _train(tmp_path, "a"), _train(tmp_path, "b")  # separate caches: the answers are made twice
    for name in ("model.safetensors", "draft_vocab.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    report = json.loads((a / "eval.json").read_text())
    card = (a / "README.md").read_text()
    for workload, ev in report["heldout"].items():
        alphas = ev["acceptance"]["4"]["alpha_per_position"]
        assert len(alphas) == 4 and all(0.0 <= x <= 1.0 for x in alphas)
        assert f"| {workload} | " + " | ".join(f"{x:.3f}" for x in alphas) in card
    assert f"ratio **{report['cost']['ratio']:.3f}**" in card and 0 < report["cost"]["ratio"] < 1
    draft = report["draft_cost"]  # a 4-token draft as served, against a target step
    assert draft["k"] == 4 and draft["sequential_draft_ms"] > 0 and draft["dtype"] in ("bfloat16", "float32")
    assert f"**{draft['sequential_share']:.2f}** of a target step" in card
    # only the trained parts are written: no embeddings, no output head
    from safetensors import safe_open

    with safe_open(str(a / "model.safetensors"), "pt") as f:
        assert not any("embed_tokens" in k or "lm_head" in k for k in f.keys())
