"""Scheduler and block manager alone: plain Python, no model."""
from __future__ import annotations

import pytest

from specd.engine.block_manager import BlockManager
from specd.engine.scheduler import Scheduler
from specd.engine.sequence import Sequence, SeqStatus
from specd.sampling import SamplingParams


def _seq(n: int) -> Sequence:
    return Sequence(list(range(1, n + 1)), SamplingParams(max_tokens=100))


def _run_step(sched: Scheduler, batch) -> None:
    """What the engine does after a forward: mark computed, append a token where sampled."""
    for e in batch:
        e.seq.num_computed_tokens += e.num_new_tokens
        if e.num_logits:
            e.seq.output_token_ids.append(7)


def test_block_manager_allocate_truncate_free():
    bm = BlockManager(num_blocks=5, block_size=4)
    s = _seq(1)
    assert bm.allocate(s, 9) and len(s.block_table) == 3 and bm.num_free_blocks == 2
    assert not bm.allocate(s, 21)  # needs 6 blocks in all: refused without change
    assert len(s.block_table) == 3 and bm.num_free_blocks == 2
    bm.truncate(s, 5)  # keep 2 blocks
    assert len(s.block_table) == 2 and bm.num_free_blocks == 3
    bm.free(s)
    assert s.block_table == [] and bm.num_free_blocks == 5
    with pytest.raises(ValueError, match="block"):
        BlockManager(0, 4)


def test_token_budget_chunks_prefill_and_only_last_chunk_samples():
    sched = Scheduler(BlockManager(100, 4), max_num_seqs=8, max_num_batched_tokens=10)
    a, b = _seq(8), _seq(8)
    sched.add(a), sched.add(b)
    batch = sched.schedule()
    assert [(e.seq, e.num_new_tokens, e.num_logits) for e in batch] == [(a, 8, 1), (b, 2, 0)]
    _run_step(sched, batch)
    batch = sched.schedule()  # a decodes 1 token, b continues its prefill with the rest of the budget
    assert [(e.seq, e.num_new_tokens, e.num_logits) for e in batch] == [(a, 1, 1), (b, 6, 1)]


def test_chunked_prefill_off_waits_for_room():
    sched = Scheduler(BlockManager(100, 4), 8, 10, enable_chunked_prefill=False)
    a, b = _seq(8), _seq(8)
    sched.add(a), sched.add(b)
    assert [e.seq for e in sched.schedule()] == [a]


def test_max_num_seqs():
    sched = Scheduler(BlockManager(100, 4), max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [_seq(3) for _ in range(3)]
    for s in seqs:
        sched.add(s)
    assert [e.seq for e in sched.schedule()] == seqs[:2]
    assert seqs[2].status == SeqStatus.WAITING


def test_fcfs_admission_stops_at_first_request_without_blocks():
    sched = Scheduler(BlockManager(3, 4), max_num_seqs=8, max_num_batched_tokens=100)
    big, small = _seq(20), _seq(2)  # big needs 5 blocks of 3: it waits, and small waits behind it
    sched.add(big), sched.add(small)
    assert sched.schedule() == []


def test_preemption_frees_newest_and_recomputes_it_later():
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    old, new = _seq(8), _seq(8)  # 2 blocks each: the cache is full
    sched.add(old), sched.add(new)
    _run_step(sched, sched.schedule())  # both now have 9 tokens, 8 of them cached
    batch = sched.schedule()  # old needs a 3rd block: new is preempted
    assert [e.seq for e in batch] == [old]
    assert new.status == SeqStatus.WAITING and new.num_computed_tokens == 0 and new.block_table == []
    assert sched.num_preemptions == 1 and sched.waiting[0] is new
    assert new.output_token_ids == [7]  # outputs survive; they are recomputed as prompt
    sched.finish(old, "stop")
    assert bm.num_free_blocks == 4
    batch = sched.schedule()
    assert [(e.seq, e.num_new_tokens, e.num_logits) for e in batch] == [(new, 9, 1)]


def test_abort_waiting_and_running_frees_everything():
    bm = BlockManager(10, 4)
    sched = Scheduler(bm, 8, 100)
    a, b = _seq(5), _seq(5)
    sched.add(a)
    sched.schedule()
    sched.add(b)
    sched.finish(a, "abort"), sched.finish(b, "abort")
    assert not sched.has_unfinished() and bm.num_free_blocks == 10
    assert a.finish_reason == b.finish_reason == "abort"
