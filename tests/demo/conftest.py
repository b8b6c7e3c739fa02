"""Shared fixtures for the demo-pair tests: the committed models folder, loaded once."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may touch the network

import pytest
import torch

from specd_train.demo.command import default_models_dir
from specd_train.demo.models import DRAFTER_NAME, TARGET_NAME
from specd_train.demo.pipeline import EVAL_FILE


@pytest.fixture(scope="session")
def models_dir():
    root = default_models_dir()
    if not (root / "CHECKSUMS.sha256").is_file():
        pytest.skip(f"no committed demo models in {root}; run `specd demo-models --retrain`")
    return root


@pytest.fixture(scope="session")
def report(models_dir):
    return json.loads((models_dir / DRAFTER_NAME / EVAL_FILE).read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def pair(models_dir):
    from specd_train.demo.models import load_model

    return load_model(models_dir / TARGET_NAME), load_model(models_dir / DRAFTER_NAME)


@pytest.fixture
def restore_torch_globals():
    """Training sets threads and deterministic mode process-wide; put them back after."""
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(det)
