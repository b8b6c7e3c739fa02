"""`speculative: {"cache_output": false}`: a request's answer stays out of the suffix index's cache
of finished answers, whether the index runs inside the verifier (--local-drafter) or as a drafter
service (the flag then crosses both protos: gateway -> verifier -> drafter), while the request
still drafts from what others let in. Real processes on loopback, the official client."""
from __future__ import annotations

import grpc
import openai
import pytest
from test_verifier_drafters import MAX_TOKENS, MODEL, TARGET_DIR, _drafters, _wait, prompts, reference, tokenizer  # noqa: F401

from specd.v1 import verifier_pb2_grpc as pbg


@pytest.fixture(scope="module")
def stack(launcher):
    sx = launcher.start("drafter-sx", "drafter", ["--method", "suffix", "--name", "sx"])
    verifier = launcher.start("verifier", "verifier", ["--model", TARGET_DIR, "--drafter", f"sx={sx.address}",
                                                       "--local-drafter", "suffix"])
    gateway = launcher.start("gateway", "gateway", ["--verifier", verifier.address], http=True)
    stub = pbg.VerifierStub(grpc.insecure_channel(verifier.address))
    _wait(lambda: len(_drafters(stub)) == 2 and all(d.healthy for d in _drafters(stub).values()))
    return openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="x", max_retries=0, timeout=120)


def answer(client, prompt, drafter: str, cache_output: bool | None) -> tuple[str, int, int]:
    """One greedy completion with 8 drafts a step from `drafter` -> (text, completion tokens, accepted drafts)."""
    spec = {"num_speculative_tokens": 8, "drafter": drafter}
    if cache_output is not None:
        spec["cache_output"] = cache_output
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"speculative": spec})
    return r.choices[0].text, r.usage.completion_tokens, r.usage.model_extra["speculative"]["accepted_tokens"]


@pytest.mark.parametrize("drafter, which", [("suffix", 0), ("sx", 1)])
def test_an_answer_kept_out_of_the_cache_is_not_drafted_from(stack, prompts, reference, drafter, which):
    prompt = prompts[which]  # one prompt per drafter: the two caches stay apart
    text, n, _ = answer(stack, prompt, drafter, cache_output=False)
    assert text == reference[which] and n > 8
    # The same prompt again: greedy, the same answer; nothing of the first is cached to draft it.
    text, _, private = answer(stack, prompt, drafter, cache_output=False)
    assert text == reference[which]
    # Once an answer is let in (the default), the next request drafts from it wherever its own
    # history has no draft (where it has one, that stands): most of the answer is accepted.
    answer(stack, prompt, drafter, cache_output=None)
    text, n, cached = answer(stack, prompt, drafter, cache_output=False)
    assert text == reference[which]
    assert cached >= 0.7 * (n - 1) and cached > private + 4, (cached, private, n)


def test_a_bad_cache_output_is_a_400(stack, prompts):
    with pytest.raises(openai.BadRequestError) as e:
        stack.completions.create(model=MODEL, prompt=prompts[0], max_tokens=4,
                                 extra_body={"speculative": {"cache_output": [1]}})
    assert "cache_output" in str(e.value)
