"""End to end: a real `specd verifier` process and a real `specd gateway` process on loopback,
driven through the official `openai` client; greedy output must equal the offline engine's."""
from __future__ import annotations

import json

import pytest

from specd.models.demo_paths import demo_model_dir
from specd.gateway.prompts import chat_prompt_ids
from specd.sampling import SamplingParams

MODEL = "specd-demo-target"
MODEL_DIR = demo_model_dir("target")
N = 24  # tokens per greedy request: enough to cross several chunks, cheap on one CPU thread

pytestmark = pytest.mark.skipif(not (MODEL_DIR / "config.json").is_file(), reason="the bundled demo target is missing")


@pytest.fixture(scope="module")
def gateway(launcher):
    """The gateway process (conftest's launcher) in front of a verifier running float32 on one thread."""
    verifier = launcher.start("verifier", "verifier", ["--model", str(MODEL_DIR), "--dtype", "float32",
                                                       "--device", "cpu", "--log-level", "warning"])
    return launcher.start("gateway", "gateway", ["--verifier", verifier.address, "--max-body-bytes", "65536",
                                                 "--log-level", "warning"], http=True)


@pytest.fixture(scope="module")
def client(gateway):
    import openai

    return openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(get_llm):
    """Greedy output of the offline engine (float32, CPU) for a list of prompt token ids."""
    llm = get_llm(str(MODEL_DIR))

    def run(prompt_ids: list[int], max_tokens: int = N):
        (out,) = llm.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=max_tokens))
        return out

    run.tokenizer = llm.tokenizer
    return run


PROMPT = "def fibonacci(n):\n    "
MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list: ünïcode 🎉"}]


def test_greedy_completion_matches_the_offline_engine(client, reference):
    ref = reference(reference.tokenizer.encode(PROMPT))
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0)
    assert whole.choices[0].text == ref.text
    assert whole.choices[0].finish_reason == ref.finish_reason
    assert whole.usage.completion_tokens == len(ref.token_ids)
    assert whole.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert set(whole.usage.model_extra["speculative"]) == {"drafts", "draft_tokens", "accepted_tokens",
                                                           "accepted_per_pos", "mean_acceptance_length", "drafters"}

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_greedy_chat_matches_the_offline_engine(client, reference):
    ref = reference(chat_prompt_ids(reference.tokenizer, MESSAGES))
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=N, temperature=0)
    assert whole.choices[0].message.content == ref.text and whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(ref.prompt_token_ids)

    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=N, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    # the verifier's default stream interval (40 ms) joins this tiny model's ~ms steps into fewer chunks
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) < len(ref.token_ids)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_speculation_off_per_request_gives_the_same_greedy_text(client, reference):
    ref = reference(reference.tokenizer.encode(PROMPT))
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0,
                                    extra_body={"speculative": {"num_speculative_tokens": 0}})
    assert out.choices[0].text == ref.text
    assert out.usage.model_extra["speculative"]["drafts"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_greedy_text(client, reference, stream):
    ref = reference(reference.tokenizer.encode(PROMPT))
    text = ref.text
    assert len(text.strip()) >= 6, "the greedy reference is too short to pick a stop string from"
    start = len(text) // 2
    stop_str = text[start:start + 3]
    expected = text[:text.index(stop_str)]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, stop=[stop_str],
                                    stream=stream)
    if stream:
        chunks = list(out)
        got, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        got, finish = out.choices[0].text, out.choices[0].finish_reason
    assert got == expected and finish == "stop"


def test_chosen_token_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert all(c.logprob <= 0 and c.top_logprobs == [] for c in content)


BAD_CALLS = [
    ("temperature < 0", dict(temperature=-0.5), "temperature"),
    ("top_p > 1", dict(top_p=1.5), "top_p"),
    ("max_tokens < 1", dict(max_tokens=0), "max_tokens"),
    ("max_tokens over the context", dict(max_tokens=100_000), "max_tokens"),
    ("prompt over the context", dict(prompt="x " * 2000), "prompt"),
    ("unknown model", dict(model="gpt-4o"), "model"),
    ("n < 1", dict(n=-1), "n"),
    ("best_of other than n", dict(n=2, best_of=3), "best_of"),
    ("presence_penalty out of range", dict(presence_penalty=2.5), "presence_penalty"),
    ("logit_bias key not a token id", dict(logit_bias={"five": 5}), "logit_bias"),
    ("min_tokens over max_tokens", dict(extra_body={"min_tokens": 9}), "min_tokens"),
    ("echo", dict(echo=True), "echo"),
    ("suffix", dict(suffix="x"), "suffix"),
    ("mistyped field", dict(extra_body={"temperature": "warm"}), "temperature"),
    ("unknown field", dict(extra_body={"frobnicate": True}), "frobnicate"),
]


@pytest.mark.parametrize("what,kwargs,param", BAD_CALLS, ids=[b[0] for b in BAD_CALLS])
def test_bad_inputs_through_the_client(client, what, kwargs, param):
    import openai

    args = dict(model=MODEL, prompt="hello", max_tokens=4)
    args.update(kwargs)
    with pytest.raises(openai.APIStatusError) as exc:
        client.completions.create(**args)
    err = exc.value
    assert err.status_code == (404 if param == "model" else 400)
    assert set(err.body) == {"message", "type", "param", "code"} and err.body["param"] == param


def test_bad_raw_bodies_and_the_gateway_stays_healthy(gateway, client):
    import httpx

    base = f"http://{gateway.address}"
    cases = [
        (b"{\"model\": ", 400),  # malformed JSON
        (json.dumps({"model": MODEL}).encode(), 400),  # missing messages
        (json.dumps({"messages": [{"role": "user"}], "max_tokens": "many"}).encode(), 400),
        (json.dumps({"messages": [{"role": "user", "content": "x" * 70_000}]}).encode(), 413),  # > --max-body-bytes
    ]
    for body, status in cases:
        r = httpx.post(f"{base}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(f"{base}/health").status_code == 200
    assert gateway.proc.poll() is None
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0)
    assert out.usage.completion_tokens >= 1
