"""Retraining twice gives byte-identical weights and tokenizer (tiny smoke spec)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from specd_train.demo.models import DRAFTER_NAME, TARGET_NAME
from specd_train.demo.pipeline import SMOKE, build_pair

COMPARED = ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json")


def test_retrain_is_bit_identical(tmp_path, restore_torch_globals):
    first = build_pair(SMOKE, tmp_path / "a", threads=1)
    second = build_pair(SMOKE, tmp_path / "b", threads=1)
    for name in (TARGET_NAME, DRAFTER_NAME):
        for f in COMPARED:
            a, b = (tmp_path / "a" / name / f).read_bytes(), (tmp_path / "b" / name / f).read_bytes()
            assert a == b, f"{name}/{f} differs between two identical trainings"
    assert first["eval"] == second["eval"]  # same numbers, only timings may differ
    assert (tmp_path / "a" / "CHECKSUMS.sha256").is_file()


def test_reusing_a_target_gives_the_full_runs_drafter(tmp_path, restore_torch_globals):
    build_pair(SMOKE, tmp_path / "full", threads=1)
    build_pair(SMOKE, tmp_path / "reused", threads=1, reuse_target=tmp_path / "full")
    for name in (TARGET_NAME, DRAFTER_NAME):
        a = (tmp_path / "full" / name / "model.safetensors").read_bytes()
        assert a == (tmp_path / "reused" / name / "model.safetensors").read_bytes(), name
    with pytest.raises(ValueError, match="target_steps"):  # a target trained differently is refused
        build_pair(replace(SMOKE, target_steps=SMOKE.target_steps + 1), tmp_path / "other", threads=1,
                   reuse_target=tmp_path / "full")
