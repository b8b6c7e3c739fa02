"""Stop strings are applied in the verifier (issue 14): it ends generation at the token that
completes the string, so usage counts no token past it, streamed or not, with speculation
committing several tokens per step. Real verifier, ngram drafter and gateway processes."""
from __future__ import annotations

import time

import grpc
import openai
import pytest

from specd.models.demo_paths import demo_model_dir
from specd.sampling import SamplingParams
from specd.models.tokenizer import Tokenizer
from specd.v1 import verifier_pb2 as pb
from specd.v1 import verifier_pb2_grpc as pbg
from specd.rpc.wire import params_to_proto

TARGET = str(demo_model_dir("target"))
PROMPT = "for i in range(10):\n    for j in range(10):\n        "
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def stack(launcher):
    ng = launcher.start("drafter", "drafter", ["--method", "ngram", "--options", '{"prompt_lookup_min": 1}'])
    verifier = launcher.start("verifier", "verifier", ["--model", TARGET, "--drafter", f"ng={ng.address}"])
    gateway = launcher.start("gateway", "gateway", ["--verifier", verifier.address], http=True)
    stub = pbg.VerifierStub(grpc.insecure_channel(verifier.address))
    deadline = time.monotonic() + 60
    while not any(d.healthy for d in stub.ListDrafters(pb.ListDraftersRequest(), timeout=10).drafters):
        assert time.monotonic() < deadline, "the ngram drafter never registered"
        time.sleep(0.2)
    return dict(verifier=verifier, gateway=gateway)


@pytest.fixture(scope="module")
def reference():
    from specd.llm import LLM

    (out,) = LLM(TARGET).generate([PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    tok = Tokenizer.from_dir(TARGET)
    texts = [tok.decode(out.token_ids[:i + 1]) for i in range(len(out.token_ids))]
    text = out.text  # a stop string that first appears a third of the way in or later
    stop = next(text[i:i + n] for i in range(len(text) // 3, len(text)) for n in (4, 8, 12)
                if text.find(text[i:i + n]) >= len(text) // 3)
    done = next(i for i, t in enumerate(texts) if stop in t)  # the token that completes it
    return dict(out=out, stop=stop, done=done, text=out.text[:out.text.find(stop)])


def test_usage_counts_no_token_past_the_stop(stack, reference):
    client = openai.OpenAI(base_url=f"http://{stack['gateway'].address}/v1", api_key="x", max_retries=0, timeout=120)
    kw = dict(model="specd-demo-target", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=[reference["stop"]],
              extra_body={"ignore_eos": True, "speculative": {"num_speculative_tokens": 4, "drafter": "ng"}})
    whole = client.completions.create(**kw)
    assert whole.choices[0].text == reference["text"] and whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens == reference["done"] + 1
    assert whole.usage.model_extra["speculative"]["draft_tokens"] > 0
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference["text"]
    assert chunks[-1].usage.completion_tokens == reference["done"] + 1


def test_the_verifier_itself_stops_there(stack, reference):
    stub = pbg.VerifierStub(grpc.insecure_channel(stack["verifier"].address))
    tok = Tokenizer.from_dir(TARGET)
    params = params_to_proto(SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                            stop=[reference["stop"]], num_speculative_tokens=4), drafter="ng")
    chunks = list(stub.Generate(pb.GenerateRequest(prompt_token_ids=tok.encode(PROMPT), params=params), timeout=120))
    ids = [t for c in chunks for t in c.token_ids]
    assert ids == reference["out"].token_ids[:reference["done"] + 1]
    assert chunks[-1].finish_reason == "stop" and chunks[-1].completion_tokens == len(ids)
