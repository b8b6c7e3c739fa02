"""`specd demo-models` without --retrain: checksum verification and the cards."""

from __future__ import annotations

import argparse
import shutil

import pytest

from specd_train.demo import command
from specd_train.demo.checksums import verify_checksums
from specd_train.demo.models import DRAFTER_NAME, TARGET_NAME


def _args(out, retrain=False):
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    argv = ["--out", str(out)] + (["--retrain"] if retrain else [])
    return parser.parse_args(argv)


def test_committed_files_verify_and_cards_print(models_dir, capsys):
    assert verify_checksums(models_dir) >= 13  # weights, configs, tokenizer files, eval.json
    assert command.run(_args(models_dir)) == 0
    out = capsys.readouterr().out
    assert f"# {TARGET_NAME}" in out and f"# {DRAFTER_NAME}" in out and "checksums OK" in out


def test_tampered_copy_fails_naming_the_file(models_dir, tmp_path):
    copy = tmp_path / "models"
    shutil.copytree(models_dir, copy)
    config = copy / DRAFTER_NAME / "config.json"
    config.write_bytes(config.read_bytes().replace(b'"llama"', b'"llamb"'))
    with pytest.raises(ValueError, match="specd-demo-drafter/config.json"):
        command.run(_args(copy))


def test_missing_models_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="--retrain"):
        command.run(_args(tmp_path / "nowhere"))
