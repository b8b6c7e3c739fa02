"""n > 1 over real HTTP with the official client (issue 69): the demo target behind a verifier with
a draft-model drafter and the suffix index.

- n=4 at T 0.7 with a seed: the same 4 choices on every run, with speculation off and on, whole and
  streamed (every chunk names its choice; the deltas of each choice join to its whole text);
- the prompt is computed once: the verifier's prefill counter (specd_verifier_prefill_tokens, parsed
  from its Prometheus exposition) grows by the same for n=4 as for n=1 (a fresh prompt each);
- greedy n=3 gives 3 identical choices, as vLLM does; chat and completions both; usage counts every
  choice's tokens and the prompt once.
"""
from __future__ import annotations

import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specd.models.demo_paths import demo_model_dir

pytestmark = pytest.mark.timeout(900)
TARGET, DRAFTER = str(demo_model_dir("target")), str(demo_model_dir("drafter"))
TOKENS = 24


@pytest.fixture(scope="module")
def stack(launcher):
    drafter = launcher.start("dm", "drafter", ["--method", "draft_model", "--name", "dm", "--model", DRAFTER])
    metrics = launcher.free_port()
    verifier = launcher.start("verifier", "verifier", [
        "--model", TARGET, "--drafter", f"dm={drafter.address}", "--local-drafter", "suffix",
        "--metrics-port", str(metrics), "--propose-timeout-ms", "5000"])
    gateway = launcher.start("gateway", "gateway", ["--verifier", verifier.address], http=True)
    client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="x", max_retries=0, timeout=300)
    return client, client.models.list().data[0].id, f"http://127.0.0.1:{metrics}/metrics"


def _prefilled(url: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "specd_verifier_prefill_tokens_total")


def _choices(client, model, k: int | None, **kw) -> list[str]:
    extra = {"speculative": {"num_speculative_tokens": k}} if k is not None else None
    r = client.completions.create(model=model, max_tokens=TOKENS, extra_body=extra, **kw)
    assert [c.index for c in r.choices] == list(range(kw.get("n", 1)))
    return [c.text for c in r.choices]


def test_seeded_choices_are_the_same_every_run_with_speculation_off_and_on(stack):
    client, model, _ = stack
    kw = dict(prompt="def fibonacci(n):\n    ", n=4, temperature=0.7, seed=11)
    first = _choices(client, model, 0, **kw)
    assert len(set(first)) > 1  # four draws, not one answer four times
    assert _choices(client, model, 0, **kw) == first
    assert _choices(client, model, None, **kw) == first  # the server's choice of drafter and k
    assert _choices(client, model, 3, **kw) == first
    # streamed: each chunk names its choice; each choice's deltas join to its whole text
    texts, finished = [""] * 4, set()
    for chunk in client.completions.create(model=model, max_tokens=TOKENS, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
    assert texts == first and finished == {0, 1, 2, 3}


def test_the_prompt_is_computed_once_for_n_choices(stack):
    client, model, metrics = stack
    before = _prefilled(metrics)
    one = client.completions.create(model=model, prompt="class Parser:\n    def __init__(self", max_tokens=4, n=1)
    mid = _prefilled(metrics)
    four = client.completions.create(model=model, prompt="import os\nimport sys\n\nclass Loader", max_tokens=4, n=4,
                                     temperature=0.7)
    after = _prefilled(metrics)
    assert mid - before == one.usage.prompt_tokens > 0
    assert after - mid == four.usage.prompt_tokens > 0  # not 4x: the 3 forks share the first's prompt
    assert len(four.choices) == 4 and four.usage.completion_tokens == 16


def test_greedy_chat_gives_n_identical_choices(stack):
    client, model, _ = stack
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    r = client.chat.completions.create(model=model, messages=messages, n=3, temperature=0, max_tokens=TOKENS)
    texts = [c.message.content for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2] and len(set(texts)) == 1 and texts[0]
    one = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=TOKENS)
    assert one.choices[0].message.content == texts[0]
    assert r.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    streamed = [""] * 3
    for chunk in client.chat.completions.create(model=model, messages=messages, n=3, temperature=0,
                                                max_tokens=TOKENS, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == texts
