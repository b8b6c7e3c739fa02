"""A draft model's KV cache fits the memory left: sized for 64 full-length sequences only where
the machine has room (a real draft model's long context would need tens of GB), else the CPU cache
budget the verifier's takes too; a sequence it has no room for gets no drafts instead of a crash."""
from __future__ import annotations

import pytest

from specd.engine import kv_memory
from specd.engine.model_runner import ModelRunner
from specd.models.demo_paths import demo_model_dir
from specd.proposers.base import ProposeRequest
from specd.proposers.draft_model import DRAFT_SEQUENCES, DraftModelProposer

LEFT = 8 * 2**20  # the memory left, as the patched process sees it


def _blocks_and_sizes(proposer) -> tuple[int, int, int]:
    per_block = ModelRunner.kv_bytes_per_block(proposer.model, 16, proposer.dtype)
    per_seq = -(-proposer.max_model_len // 16)
    return proposer.blocks.num_total_blocks, per_block, per_seq


def test_with_room_the_cache_holds_64_full_length_sequences():
    proposer = DraftModelProposer(str(demo_model_dir("drafter")), dtype="float32", device="cpu")
    blocks, per_block, per_seq = _blocks_and_sizes(proposer)
    assert blocks * per_block <= kv_memory.default_cpu_budget()  # (the default drafter's 64 fit in 1 GB)
    assert blocks == per_seq * DRAFT_SEQUENCES


def test_with_little_memory_left_the_cache_takes_half_of_it_and_still_drafts(monkeypatch, caplog):
    monkeypatch.setattr(kv_memory, "available_memory_bytes", lambda: LEFT)
    with caplog.at_level("WARNING"):
        proposer = DraftModelProposer(str(demo_model_dir("drafter")), dtype="float32", device="cpu")
    blocks, per_block, per_seq = _blocks_and_sizes(proposer)
    assert blocks == int(LEFT * kv_memory.CPU_KV_SHARE_OF_AVAILABLE // per_block) < per_seq * DRAFT_SEQUENCES
    assert "draft model KV cache" in caplog.text
    history = [5, 17, 99, 240, 31, 8, 77, 150]
    (p,) = proposer.propose([ProposeRequest(seq_id=1, new_tokens=history, num_tokens=len(history), k=4,
                                            full_history=True, temperature=0.0)])
    assert len(p.token_ids) == 4


def test_a_cache_larger_than_the_memory_left_is_refused_at_start(monkeypatch):
    monkeypatch.setattr(kv_memory, "available_memory_bytes", lambda: LEFT)
    with pytest.raises(ValueError, match="does not fit in the .* GB of memory left"):
        DraftModelProposer(str(demo_model_dir("drafter")), dtype="float32", device="cpu", num_blocks=10**6)
