"""`specd drafter-data`'s shards (training/specd_train/drafter/data.py) on the demo target: a shard is the
same whatever the batch it was decoded at, a rerun makes only what is missing, and a deadline
stops it cleanly."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from specd.models.demo_paths import models_root
from specd_train.drafter import data


@pytest.fixture
def small_shards(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECD_CACHE", str(tmp_path))
    monkeypatch.setattr(data, "SHARD", 6)
    return models_root() / "specd-demo-target", data.DataConfig(max_tokens=16)


def _shard(root: Path, i: int) -> dict:
    return torch.load(data.shard_path(root, i))


def test_shards_resume_and_do_not_depend_on_the_batch(small_shards):
    target, cfg = small_shards
    first = data.make_shards(target, 2, cfg, batch=6)
    root = Path(first["dir"])
    assert first["shards"] == 2 and first["conversations"] == 12
    kept, remade = _shard(root, 0), _shard(root, 1)
    for ids, n in zip(kept["ids"], kept["prompt_lens"]):
        assert 0 < n < len(ids) <= n + cfg.max_tokens  # a chat prompt, then the target's answer
    assert set(kept["kinds"]) <= {"self_asked", "built"} and "built" in kept["kinds"]
    mtime = data.shard_path(root, 0).stat().st_mtime_ns
    data.shard_path(root, 1).unlink()
    again = data.make_shards(target, 3, cfg, batch=2)  # shard 1 again, and a new one, at another batch
    assert again["shards"] == 3
    assert data.shard_path(root, 0).stat().st_mtime_ns == mtime  # what was there is kept, not remade
    assert [t.tolist() for t in _shard(root, 1)["ids"]] == [t.tolist() for t in remade["ids"]]
    assert [t.tolist() for t in _shard(root, 2)["ids"]] != [t.tolist() for t in remade["ids"]]
    past = data.make_shards(target, 5, cfg, batch=6, deadline=time.time() - 1)
    assert past["shards"] == 3 and not list(root.glob("*.tmp"))
    assert len(data.load_sequences(root)) == 18
