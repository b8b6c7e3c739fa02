"""A running request's tokens go out at most every stream_interval_s (its first token and its end
at once): the verifier's AsyncEngine on the real demo target. Over HTTP with the default interval:
test_gateway_e2e.py (fewer chunks than tokens, the offline engine's text)."""
from __future__ import annotations

import asyncio

import pytest

from specd.models.demo_paths import demo_model_dir
from specd.sampling import SamplingParams
from specd.verifier.async_engine import AsyncEngine

MODEL_DIR = demo_model_dir("target")
N = 24

pytestmark = pytest.mark.skipif(not (MODEL_DIR / "config.json").is_file(), reason="the bundled demo target is missing")


def _deltas(engine, prompt_ids: list[int], interval_s: float) -> list:
    async def run():
        ae = AsyncEngine(engine, stream_interval_s=interval_s)
        ae.start()
        try:
            req = ae.submit("r", prompt_ids, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True))
            return [d async for d in ae.stream(req)]
        finally:
            await ae.stop()

    return asyncio.run(run())


def test_tokens_are_held_within_the_interval_and_none_lost(get_llm):
    llm = get_llm(str(MODEL_DIR), fresh=True)
    prompt = llm.tokenizer.encode("def fibonacci(n):\n    ")
    every = _deltas(llm.engine, prompt, 0.0)
    assert [len(d.token_ids) for d in every] == [1] * N  # plain decode: one token a step, a delta each
    held = _deltas(llm.engine, prompt, 3600.0)
    # the first token at once, the rest held until the request ends
    assert [len(d.token_ids) for d in held] == [1, N - 1]
    assert [d.finish_reason for d in held] == [None, "length"] and held[-1].completion_tokens == N
    assert [t for d in held for t in d.token_ids] == [t for d in every for t in d.token_ids]


def test_a_negative_interval_is_refused(get_llm):
    llm = get_llm(str(MODEL_DIR))
    with pytest.raises(ValueError, match="stream-interval-ms"):
        AsyncEngine(llm.engine, stream_interval_s=-0.001)
