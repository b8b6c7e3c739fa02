"""A fault of ours while a request is added to the engine (a bug, not a refusal) fails that request
alone with an engine error (INTERNAL over gRPC): the requests in flight finish with the tokens they
would have had, the engine keeps no part of the failed one, and the next request is served. Once,
such a fault (an IndexError in a check) ended every request in flight. The fault is injected into the
real engine on the demo target: its sequence construction raises for one marked request."""
from __future__ import annotations

import asyncio

import pytest

from specd.models.demo_paths import demo_model_dir
from specd.sampling import SamplingParams
from specd.verifier.async_engine import AsyncEngine, EngineFailure

MODEL_DIR = demo_model_dir("target")
FAULTY_MAX_TOKENS = 7  # the marked request

pytestmark = pytest.mark.skipif(not (MODEL_DIR / "config.json").is_file(), reason="the bundled demo target is missing")


def _greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n, seed=100 if n > 1 else None)


@pytest.fixture
def engine(get_llm, monkeypatch):
    llm = get_llm(str(MODEL_DIR), fresh=True)
    real = llm.engine._sequence

    def faulty(prompt, params, seq_id):
        # the marked request's sequence; with n = 3 and seed 100 its second choice's (seed 101), after
        # the first choice's sequence was made
        if params.max_tokens == FAULTY_MAX_TOKENS and (params.n == 1 or params.seed == 101):
            raise RuntimeError("injected fault")
        return real(prompt, params, seq_id)

    monkeypatch.setattr(llm.engine, "_sequence", faulty)
    return llm


async def _collect(ae, req):
    return [t for d in [d async for d in ae.stream(req)] for t in d.token_ids]


def test_a_fault_adding_one_request_fails_it_alone(engine):
    prompt = engine.tokenizer.encode("def fibonacci(n):\n    ")

    async def run():
        ae = AsyncEngine(engine.engine)
        ae.start()
        try:
            alone = await _collect(ae, ae.submit("alone", prompt, _greedy(40)))
            first = ae.submit("in-flight", prompt, _greedy(40))
            task = asyncio.create_task(_collect(ae, first))
            while not first.sent:  # in flight: it has its first token
                await asyncio.sleep(0.01)
            results = {}
            for name, n in [("faulty", 1), ("faulty-n3", 3)]:
                with pytest.raises(EngineFailure, match="injected fault"):
                    await _collect(ae, ae.submit(name, prompt, _greedy(FAULTY_MAX_TOKENS, n)))
            results["in-flight"] = await task
            results["after"] = await _collect(ae, ae.submit("after", prompt, _greedy(12)))
            return alone, results, dict(engine.engine.sequences), len(ae.requests)
        finally:
            await ae.stop()

    alone, results, left, requests_left = asyncio.run(run())
    assert results["in-flight"] == alone and len(alone) == 40  # untouched by the fault beside it
    assert results["after"] == alone[:12]  # served after it
    assert left == {} and requests_left == 0  # nothing of the failed requests kept (the n = 3 one had made its first)
