"""Scheduler and block manager alone: plain Python, no model."""
from __future__ import annotations

import pytest

from specd.engine.block_manager import BlockManager
from specd.engine.scheduler import Drafts, Scheduler
from specd.engine.sequence import Sequence, SeqStatus
from specd.sampling import SamplingParams


def _seq(n: int, **params) -> Sequence:
    return Sequence(list(range(1, n + 1)), SamplingParams(**{"max_tokens": 100, **params}))


def _run_step(sched: Scheduler, batch) -> None:
    """What the engine does after a forward: commit one sampled token (7) per sampled entry."""
    sched.postprocess(batch, [[7] for e in batch if e.num_logits])


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


def _decoding(sched: Scheduler, *seqs: Sequence):
    """Prefill seqs (one step), then schedule the decode step."""
    for s in seqs:
        sched.add(s)
    _run_step(sched, sched.schedule())
    return sched.schedule()


def test_attach_drafts_allocates_their_blocks_or_leaves_the_entry_plain():
    bm = BlockManager(num_blocks=5, block_size=4)
    sched = Scheduler(bm, 8, 100)
    a, b = _seq(7), _seq(3)
    batch = _decoding(sched, a, b)  # a: 8 tokens (2 blocks), b: 4 tokens (1 block); 2 free
    sched.attach_drafts(batch, {a.seq_id: Drafts([5, 6, 7], drafter="x"), b.seq_id: Drafts([9] * 8)})
    ea, eb = batch
    assert (ea.num_new_tokens, ea.num_logits, ea.draft_token_ids, ea.drafts.drafter) == (4, 4, [5, 6, 7], "x")
    assert len(a.block_table) == 3  # positions 7..10 need a third block
    assert (eb.num_new_tokens, eb.num_logits, eb.drafts, eb.draft_token_ids) == (1, 1, None, [])  # 3 blocks > 1 free
    assert len(b.block_table) == 1 and bm.num_free_blocks == 1


def test_postprocess_commits_accepted_drafts_and_rolls_back_the_rest():
    bm = BlockManager(num_blocks=10, block_size=4)
    sched = Scheduler(bm, 8, 100)
    a = _seq(7)
    batch = _decoding(sched, a)  # 8 tokens, 7 computed
    sched.attach_drafts(batch, {a.seq_id: Drafts([5, 6, 8, 9])})  # positions 7..11: 3 blocks
    assert len(a.block_table) == 3
    recorded = []

    class Recorder:
        def record(self, seq, row, token):
            recorded.append((row, token))

    assert sched.postprocess(batch, [[5, 4]], Recorder()) == []  # 1 accepted, then a recovered token
    assert a.output_token_ids == [7, 5, 4] and a.num_computed_tokens == 9  # last token + 1 draft
    assert len(a.block_table) == 3 and bm.num_free_blocks == 7  # 9 tokens: still 3 blocks
    assert recorded == [(0, 5), (1, 4)]
    batch = sched.schedule()
    sched.attach_drafts(batch, {a.seq_id: Drafts([1, 2, 3, 4])})  # positions 9..13: 4 blocks
    assert len(a.block_table) == 4
    sched.postprocess(batch, [[6]])  # all rejected: the 4th block goes back
    assert a.num_computed_tokens == 10 and len(a.block_table) == 3 and bm.num_free_blocks == 7


def test_postprocess_stops_inside_accepted_drafts_and_at_the_caps():
    eos = 2
    sched = Scheduler(BlockManager(50, 4), 8, 100, eos_token_ids=[eos], max_model_len=20)
    a, b, c, d = _seq(5), _seq(5, stop_token_ids=[9]), _seq(5, max_tokens=3), _seq(17, ignore_eos=True)
    batch = _decoding(sched, a, b, c, d)
    sched.attach_drafts(batch, {s.seq_id: Drafts([4, 4, 4]) for s in (a, b, c, d)})
    finished = sched.postprocess(batch, [[4, eos, 4, 4], [9, 4, 4, 4], [4, 4, 4, 4], [eos, 4, 4, 4]])
    assert finished == [a, b, c, d]
    assert (a.output_token_ids, a.finish_reason) == ([7, 4, eos], "stop")  # eos ends it right there
    assert (b.output_token_ids, b.finish_reason) == ([7, 9], "stop")  # a stop token id
    assert (c.output_token_ids, c.finish_reason) == ([7, 4, 4], "length")  # max_tokens 3
    assert (d.output_token_ids, d.finish_reason) == ([7, eos, 4], "length")  # ignore_eos; max_model_len 20
    assert not sched.has_unfinished() and sched.blocks.num_free_blocks == 50


def test_a_stop_inside_accepted_drafts_caches_only_the_blocks_it_keeps():
    """Drafts accepted past an eos had their KV computed: the finished sequence's prefix-cache
    commit must stop at its own tokens (it had hashed blocks of tokens it lacked: IndexError)."""
    eos = 2
    bm = BlockManager(50, 4, enable_prefix_caching=True)
    sched = Scheduler(bm, 8, 100, eos_token_ids=[eos])
    a = _seq(6)
    batch = _decoding(sched, a)  # 7 tokens, 6 computed
    sched.attach_drafts(batch, {a.seq_id: Drafts([4, 4, 4, 4, 4])})  # positions 6..11
    assert sched.postprocess(batch, [[eos, 4, 4, 4, 4, 4]]) == [a]  # every draft accepted, eos first
    assert a.output_token_ids == [7, eos] and a.finish_reason == "stop"
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 50  # 8 tokens: two full blocks, none past them
    b = Sequence(a.prompt_token_ids + a.output_token_ids + [5], SamplingParams(max_tokens=4))
    assert len(bm.match_prefix(b)) == 2


def test_a_finish_that_fails_to_cache_still_frees_its_blocks():
    class Failing(BlockManager):
        fail = False

        def commit(self, seq):
            if self.fail:
                raise RuntimeError("commit failed")
            return super().commit(seq)

    bm = Failing(10, 4, enable_prefix_caching=True)
    sched = Scheduler(bm, 8, 100)
    a = _seq(6)
    _decoding(sched, a)
    bm.fail = True
    with pytest.raises(RuntimeError):
        sched.finish(a, "stop")
    # Finished, so the verifier's abort of every request after the failed step (LLMEngine.abort)
    # passes over it, and none of its blocks is lost.
    assert a.is_finished and bm.num_free_blocks == 10 and not sched.running and not sched.has_unfinished()


def test_postprocess_runs_the_stop_checker():
    class StopAfter:
        def __init__(self, token):
            self.token = token

        def add(self, token):
            return token == self.token

    sched = Scheduler(BlockManager(50, 4), 8, 100)
    a = _seq(5)
    a.stop_checker = StopAfter(6)
    batch = _decoding(sched, a)
    sched.attach_drafts(batch, {a.seq_id: Drafts([5, 6])})
    assert sched.postprocess(batch, [[5, 6, 8]]) == [a]
    assert a.output_token_ids == [7, 5, 6] and a.finish_reason == "stop"
