"""A drafter reading a whole history (first contact, a resync) is a one-off per sequence, not what a
speculative or plain cycle costs: the controller's calibration leaves such cycles out.

Timed, a batch's first contacts with a model drafter took the speculative calibration of batch 8 from
1.0 to 0.5, then 0.18, where it priced the suffix index's offers out for the rest of the run (code edits
at batch 8 after chat, 2-core Xeon without AMX, 2026-11-30). Real parts: a real n-gram drafter, asked as
a model drafter is and made to take 0.3 s over each whole history, in-process (the step waits for the
read) and served by the real DrafterService on loopback gRPC behind the verifier's pool (read in the
background); both tests fail with SpecController.not_timed left uncalled.
"""
from __future__ import annotations

import asyncio
import time

import grpc
import transformers

from specd.config import EngineConfig, SpeculativeConfig
from specd.drafter.server import DrafterService
from specd.engine.llm_engine import LLMEngine
from specd.proposers.ngram import NgramProposer
from specd.sampling import SamplingParams
from specd.v1 import drafter_pb2, drafter_pb2_grpc
from specd.verifier.drafter_pool import DrafterPool
from specd.verifier.pool_proposer import PoolProposer

READ_S = 0.3  # what reading a whole history takes the slow drafter below (far above a cycle here)


class SlowReader:
    """A real drafter (an n-gram index: cheap, so the controller speculates on a tiny target) that
    takes READ_S over every whole history it is sent, as a draft model computing a prompt does; asked
    after the plan as a model drafter is, not before it as an in-process index."""

    answers_inline = False

    def __init__(self, inner: NgramProposer, read_s: float = READ_S):
        self.inner, self.read_s, self.reads = inner, read_s, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, batch):
        if any(r.full_history for r in batch):
            self.reads += sum(r.full_history for r in batch)
            time.sleep(self.read_s)
        return self.inner.propose(batch)


def _timed_cycles(engine: LLMEngine) -> list[tuple[str, float]]:
    """Records every cycle the calibration takes in: (mode, seconds)."""
    calibration, seen = engine.speculator.controller.calibration, []
    observe = calibration.observe

    def recording(num_seqs, mode, seconds, *args, **kwargs):
        if mode in ("plain", "spec"):
            seen.append((mode, seconds))
        return observe(num_seqs, mode, seconds, *args, **kwargs)

    calibration.observe = recording
    return seen


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> None:
    """The requests arrive one after another, each while the others decode (a new sequence each time)."""
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        if pending:
            i, p = pending.pop(0)
            engine.add_request(p, params, seq_id=i)
        for _ in range(6):
            engine.step()


def test_a_cycle_in_which_the_drafter_reads_a_whole_history_is_not_timed(model_dirs, make_prompts):
    target = model_dirs["llama3"]
    slow = SlowReader(NgramProposer(num_speculative_tokens=4))
    engine = LLMEngine(EngineConfig(model=target, dtype="float32", seed=0),
                       SpeculativeConfig(method="ngram", num_speculative_tokens=4), proposer=slow)
    seen = _timed_cycles(engine)
    _run(engine, make_prompts(6, seed=5, lengths=[20] * 6), SamplingParams(temperature=0.0, max_tokens=40,
                                                                          ignore_eos=True))
    assert slow.reads >= 2, "the drafter read fewer than two histories"
    assert len(seen) >= 10, seen  # cycles were timed (whether the model picked speculation is timing's)
    # Not one timed cycle holds a history read (each is READ_S long; the others take milliseconds).
    assert max(s for _, s in seen) < READ_S, sorted(seen, key=lambda m: -m[1])[:3]


def _on(loop, coro, timeout=30):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


async def _serve(proposer, vocab: int) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    info = drafter_pb2.DrafterInfoResponse(name="slow", method="ngram", vocab_size=vocab, max_k=8)
    drafter_pb2_grpc.add_DrafterServicer_to_server(DrafterService(proposer, info), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_cycles_while_a_drafter_service_reads_in_the_background_are_not_timed(loop, model_dirs, make_prompts):
    """The pool sends a new history to a drafter that would not read it within its deadline in the
    background (the step does not wait): the drafter then computes on cores the verifier shares, so
    the cycles until it has read it are not timed either."""
    target = model_dirs["llama3"]
    vocab = transformers.AutoConfig.from_pretrained(target).vocab_size
    slow = SlowReader(NgramProposer(num_speculative_tokens=4), read_s=0.05)  # beyond half the pool's deadline
    server, address = _on(loop, _serve(slow, vocab))
    pool = DrafterPool(vocab, "", timeout_s=0.1)
    proposer = PoolProposer(pool, loop)
    engine = LLMEngine(EngineConfig(model=target, dtype="float32", seed=0),
                       SpeculativeConfig(num_speculative_tokens=3), proposer=proposer)
    _on(loop, pool.register("slow", address))
    seen = _timed_cycles(engine)
    reading_steps = []
    propose = engine.speculator.propose

    def watched(batch, budget_left):
        drafts = propose(batch, budget_left)
        reading_steps.append((proposer.reading_histories, engine.speculator.controller.step_mode))
        return drafts

    engine.speculator.propose = watched
    try:
        _run(engine, make_prompts(4, seed=6, lengths=[20] * 4), SamplingParams(temperature=0.0, max_tokens=300,
                                                                              ignore_eos=True))
    finally:
        _on(loop, pool.close())
        _on(loop, server.stop(None))
    assert slow.reads >= 2
    assert any(reading for reading, _ in reading_steps), "no step saw the drafter reading in the background"
    assert all(mode not in ("plain", "spec") for reading, mode in reading_steps if reading), reading_steps
    assert len(seen) >= 5, "no cycle was timed: nothing to leave out"
