"""Logprobs and top alternatives end to end: an ngram drafter, a verifier (float32, CPU) and the
gateway as real processes, driven through the official `openai` client, checked against
log_softmax of Hugging Face transformers' logits for the same prompt + generated tokens.

The logprobs are vLLM's default "raw" ones: log_softmax of the target's logits before
temperature/top-k/top-p, so the same reference holds for greedy and sampled requests, with
speculation on (several tokens per verify step) or off.
"""
from __future__ import annotations

import time
from collections import defaultdict

import grpc
import openai
import pytest
import torch

from specd.models.demo_paths import demo_model_dir
from specd.gateway.prompts import chat_prompt_ids
from specd.models.tokenizer import Tokenizer
from specd.v1 import verifier_pb2 as pb
from specd.v1 import verifier_pb2_grpc as pbg

MODEL = "specd-demo-target"
MODEL_DIR = demo_model_dir("target")
TOL = 1e-4
MAX_TOKENS = 24
# Repetitive code, so the ngram drafter finds matches and speculation really commits several tokens a step.
PROMPT = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\n"
          "def fibonacci")
MESSAGES = [{"role": "user", "content": PROMPT}]
SPEC = {"off": {"num_speculative_tokens": 0}, "on": {"num_speculative_tokens": 4}}
SAMPLING = {"greedy": dict(temperature=0), "sampled": dict(temperature=0.8, top_p=0.95, seed=7)}

pytestmark = pytest.mark.skipif(not (MODEL_DIR / "config.json").is_file(), reason="the bundled demo target is missing")


@pytest.fixture(scope="module")
def client(launcher):
    # Lookups down to 1-grams: this small model's answers reuse few longer n-grams of the prompt.
    ng = launcher.start("drafter-ng", "drafter", ["--method", "ngram", "--name", "ng", "--log-level", "warning",
                                                  "--options", '{"prompt_lookup_min": 1, "prompt_lookup_max": 3}'])
    # A generous propose deadline: on a loaded machine a missed one would only cost drafts, but
    # the speculation-on cases must really speculate.
    # No prefix cache: the tests compare a request with its own stream, logprobs to the bit, and in
    # float32 on a CPU whose kernels are not batch-invariant (exact = false) a cache hit computes the
    # prompt's tail in another layout, which moves logprobs in their last bits.
    verifier = launcher.start("verifier", "verifier", ["--model", str(MODEL_DIR), "--dtype", "float32", "--device",
                                                       "cpu", "--drafter", f"ng={ng.address}", "--no-prefix-caching",
                                                       "--propose-timeout-ms", "5000", "--log-level", "warning"])
    stub = pbg.VerifierStub(grpc.insecure_channel(verifier.address))
    deadline = time.monotonic() + 60
    while not any(d.healthy for d in stub.ListDrafters(pb.ListDraftersRequest(), timeout=10).drafters):
        assert time.monotonic() < deadline, "the ngram drafter never became healthy"
        time.sleep(0.1)
    gateway = launcher.start("gateway", "gateway", ["--verifier", verifier.address, "--log-level", "warning"],
                             http=True)
    client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="x", max_retries=0, timeout=120)
    # The pool sends a drafter's first history in the background (no drafts that step) until it
    # knows how fast the drafter reads one; afterwards every request takes the same steps. One
    # request first, so the two a test compares to the bit are laid out alike.
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                   extra_body={"speculative": SPEC["on"]})
    return client


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(MODEL_DIR)


@pytest.fixture(scope="module")
def ids_of(tokenizer):
    """token text -> the ids that decode to it (byte tokens all decode to "\\ufffd")."""
    table = defaultdict(list)
    for i in range(tokenizer.vocab_size):
        table[tokenizer.decode([i], skip_special_tokens=False)].append(i)
    return table


@pytest.fixture(scope="module")
def reference(hf_logits, ids_of):
    """(prompt ids, [(chosen text, chosen logprob)]) -> (log_softmax rows [n, V] float64, chosen ids)."""

    def run(prompt_ids: list[int], chosen: list[tuple[str, float]]):
        ids = [ids_of[text][0] for text, _ in chosen]
        for _ in range(len(chosen) + 1):  # each pass settles at least one ambiguous ("\ufffd") token
            rows = torch.log_softmax(hf_logits(str(MODEL_DIR), prompt_ids + ids).double(), -1)[len(prompt_ids) - 1:-1]
            fixed = _first_mismatch(rows, ids, chosen, ids_of)
            if fixed is None:
                return rows, ids
            i, token_id = fixed
            ids = ids[:i] + [token_id] + ids[i + 1:]
        raise AssertionError("could not match the generated tokens to ids")

    return run


def _first_mismatch(rows, ids, chosen, ids_of):
    """The first position whose id does not give the reported logprob, with an id of that text that does."""
    for i, ((text, logprob), token_id) in enumerate(zip(chosen, ids)):
        if abs(rows[i, token_id].item() - logprob) <= TOL:
            continue
        better = [t for t in ids_of[text] if abs(rows[i, t].item() - logprob) <= TOL]
        assert better, f"token {i} ({text!r}): logprob {logprob} matches no id of that text in the reference"
        return i, better[0]
    return None


def _check_alternatives(rows, i: int, top: list[tuple[str, float]], n: int, ids_of) -> None:
    """`top` holds the n most likely tokens at position i, sorted, with the reference's logprobs."""
    values = [v for _, v in top]
    assert values == sorted(values, reverse=True), f"position {i}: not sorted: {values}"
    expect = rows[i].topk(n).values.tolist()
    assert max(abs(a - b) for a, b in zip(values, expect)) <= TOL, (i, values, expect)
    for text, value in top:
        assert min(abs(rows[i, t].item() - value) for t in ids_of[text]) <= TOL, (i, text, value)


def _chat(client, stream: bool, n: int, spec: str, sampling: str):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=n,
                  extra_body={"speculative": SPEC[spec]}, **SAMPLING[sampling])
    if not stream:
        out = client.chat.completions.create(**kwargs)
        return out.choices[0].logprobs.content, out.usage
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    content = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    return content, chunks[-1].usage


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("spec", list(SPEC))
def test_chat_top_logprobs(client, tokenizer, reference, ids_of, spec, sampling):
    n = 20
    content, usage = _chat(client, False, n, spec, sampling)
    prompt_ids = chat_prompt_ids(tokenizer, MESSAGES)
    assert usage.prompt_tokens == len(prompt_ids) and len(content) == usage.completion_tokens == MAX_TOKENS
    speculative = usage.model_extra["speculative"]
    if spec == "on":  # several tokens per step were committed, each with its own row of alternatives
        assert speculative["accepted_tokens"] > 0, speculative
    else:
        assert speculative["drafts"] == 0, speculative

    rows, _ = reference(prompt_ids, [(c.token, c.logprob) for c in content])
    for i, c in enumerate(content):
        assert len(c.top_logprobs) == n and c.bytes == list(c.token.encode())
        assert all(t.bytes == list(t.token.encode()) for t in c.top_logprobs)
        _check_alternatives(rows, i, [(t.token, t.logprob) for t in c.top_logprobs], n, ids_of)
        if c.logprob >= c.top_logprobs[-1].logprob:  # among the alternatives: exactly the same number there
            assert any((t.token, t.logprob) == (c.token, c.logprob) for t in c.top_logprobs), (i, c)
        if sampling == "greedy":  # the chosen token is the most likely one
            assert (c.top_logprobs[0].token, c.top_logprobs[0].logprob) == (c.token, c.logprob), (i, c)
    if sampling == "sampled":  # at temperature 0.8 some chosen token is not the most likely: a real test of the rows
        assert any(c.top_logprobs[0].logprob != c.logprob for c in content)

    streamed, stream_usage = _chat(client, True, n, spec, sampling)
    assert stream_usage.completion_tokens == usage.completion_tokens
    assert [c.model_dump() for c in streamed] == [c.model_dump() for c in content]


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("spec", list(SPEC))
def test_completion_logprobs(client, tokenizer, reference, ids_of, spec, sampling):
    n = 5
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, logprobs=n,
                  extra_body={"speculative": SPEC[spec]}, **SAMPLING[sampling])
    out = client.completions.create(**kwargs)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == MAX_TOKENS
    if spec == "on":
        assert out.usage.model_extra["speculative"]["accepted_tokens"] > 0
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)

    rows, _ = reference(tokenizer.encode(PROMPT), list(zip(lp.tokens, lp.token_logprobs)))
    for i, (token, logprob, top) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)):
        # OpenAI: the n most likely, plus the chosen token when it is not among them.
        assert top.get(token) == logprob or (token == "\ufffd" and token in top), (i, token, logprob, top)
        most_likely = list(top.items())[:n]
        if len(top) == n + 1:  # the chosen token came last, less likely than the n others
            assert list(top)[-1] == token and logprob <= most_likely[-1][1]
        if "\ufffd" not in top:  # byte tokens share one key, so fewer than n distinct texts can come back
            assert n <= len(top) <= n + 1
            _check_alternatives(rows, i, most_likely, n, ids_of)
        if sampling == "greedy":
            assert next(iter(top.items())) == (token, logprob)

    chunks = list(client.completions.create(stream=True, **kwargs))
    parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [v for p in parts for v in p.token_logprobs] == lp.token_logprobs
    assert [t for p in parts for t in p.top_logprobs] == lp.top_logprobs
    assert [o for p in parts for o in p.text_offset] == lp.text_offset


BAD = [
    ("chat", dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("chat", dict(logprobs=True, top_logprobs=-1), "top_logprobs"),
    ("chat", dict(top_logprobs=3), "top_logprobs"),  # without logprobs=true
    ("chat", dict(logprobs=False, top_logprobs=3), "top_logprobs"),
    ("completions", dict(logprobs=6), "logprobs"),
    ("completions", dict(logprobs=-1), "logprobs"),
]


@pytest.mark.parametrize("endpoint,kwargs,param", BAD, ids=[f"{e}-{k}" for e, k, _ in BAD])
def test_bad_logprobs_values_get_a_400(client, endpoint, kwargs, param):
    with pytest.raises(openai.BadRequestError) as exc:
        if endpoint == "chat":
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, **kwargs)
        else:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, **kwargs)
    body = exc.value.body
    assert set(body) == {"message", "type", "param", "code"} and body["param"] == param
    assert body["type"] == "invalid_request_error", body
