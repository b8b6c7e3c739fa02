"""The default drafter's card is rewritten from its eval.json: what it measured, and the notes
written by hand after the generated part kept."""
from __future__ import annotations

import json
import shutil

from specd_train.drafter.card import KEPT, write_card

from specd.models.model_store import committed_drafter_dir


def test_a_rewritten_card_keeps_its_hand_written_limits_and_says_what_a_draft_costs(tmp_path):
    committed = committed_drafter_dir()
    shutil.copyfile(committed / "README.md", tmp_path / "README.md")
    report = json.loads((committed / "eval.json").read_text())
    limits = (tmp_path / "README.md").read_text().split(KEPT, 1)[1]
    assert limits.strip()  # the committed card has a hand-written section
    write_card(tmp_path, report, "specd train-drafter --threads 2")
    card = (tmp_path / "README.md").read_text()
    assert card.count(KEPT) == 1 and card.endswith(limits)
    draft = report["draft_cost"]
    assert f"costs {draft['sequential_draft_ms']:.1f} ms against a target decode step of {draft['target_step_ms']:.1f} ms" in card
    assert f"**{draft['sequential_share']:.2f}** of a target step" in card
    # and the committed card is what this template writes from the committed eval.json
    assert card == (committed / "README.md").read_text()


def test_the_card_says_the_precision_the_run_trained_in(tmp_path):
    """A run records what its forward ran in (bf16 autocast only where the CPU multiplies bf16
    natively, float32 elsewhere: specd_train.drafter.precision); the card says that, not one
    fixed precision whatever ran."""
    committed = committed_drafter_dir()
    shutil.copyfile(committed / "README.md", tmp_path / "README.md")
    report = json.loads((committed / "eval.json").read_text())
    report["train"]["precision"] = "float32 (no native bf16 matmul)"
    write_card(tmp_path, report, "specd train-drafter --threads 2")
    card = (tmp_path / "README.md").read_text()
    assert "float32 (no native bf16 matmul)" in card and "bf16 autocast" not in card
