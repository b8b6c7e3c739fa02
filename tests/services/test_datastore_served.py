"""The suffix index drafting from a datastore inside the verifier (--local-drafter
suffix:{"suffix_decoding_datastore": DIR}), as `specd up` runs it on the default target: real
processes on loopback, the official client. A datastore holding the target's answers drafts
most of them (the same index without it, as a drafter service, far fewer), the
output is the target's own; a datastore of another vocabulary stops the verifier at start, and
the offline engine too."""
from __future__ import annotations

import json

import grpc
import openai
import pytest
from test_verifier_drafters import MAX_TOKENS, MODEL, TARGET_DIR, _drafters, _wait, prompts, reference, tokenizer  # noqa: F401

from specd.models.tokenizer import vocab_hash_of
from specd.proposers.datastore import save
from specd.sampling import SamplingParams
from specd.v1 import verifier_pb2_grpc as pbg

IN_STORE = (0, 1, 2)  # the prompts whose answers the datastore holds


@pytest.fixture(scope="module")
def store(tmp_path_factory, prompts):
    from specd.llm import LLM

    outs = LLM(TARGET_DIR).generate([prompts[i] for i in IN_STORE], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    path = tmp_path_factory.mktemp("datastore")
    save(path, [list(o.token_ids) for o in outs], {"vocab_hash": vocab_hash_of(TARGET_DIR)})
    return path


@pytest.fixture(scope="module")
def client(launcher, store):
    sx = launcher.start("drafter-sx", "drafter", ["--method", "suffix", "--name", "sx", "--options",
                                                  json.dumps({"suffix_decoding_max_cached_requests": 0})])
    options = json.dumps({"suffix_decoding_datastore": str(store), "suffix_decoding_max_cached_requests": 0})
    verifier = launcher.start("verifier", "verifier", ["--model", TARGET_DIR, "--drafter", f"sx={sx.address}",
                                                       "--local-drafter", f"suffix:{options}"])
    gateway = launcher.start("gateway", "gateway", ["--verifier", verifier.address], http=True)
    stub = pbg.VerifierStub(grpc.insecure_channel(verifier.address))
    _wait(lambda: len(_drafters(stub)) == 2 and all(d.healthy for d in _drafters(stub).values()))
    return openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="x", max_retries=0, timeout=120)


def answer(client, prompt, drafter: str) -> tuple[str, int, int]:
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"speculative": {"num_speculative_tokens": 8, "drafter": drafter,
                                                              "cache_output": False}})
    return r.choices[0].text, r.usage.completion_tokens, r.usage.model_extra["speculative"]["accepted_tokens"]


@pytest.mark.parametrize("i", IN_STORE)
def test_the_datastore_drafts_the_answers_it_holds(client, prompts, reference, i):
    text, n, with_store = answer(client, prompts[i], "suffix")
    assert text == reference[i] and n > 8
    text, _, without = answer(client, prompts[i], "sx")  # the same index, no datastore
    assert text == reference[i]
    # (not all: where the request's own history drafts, its draft goes first, right or wrong)
    assert with_store >= 0.5 * (n - 1) and with_store >= without + 8, (with_store, without, n)


def test_other_answers_stay_the_targets(client, prompts, reference):
    for i in (5, 9):
        assert answer(client, prompts[i], "suffix")[0] == reference[i]


def test_a_datastore_of_another_vocabulary_stops_the_verifier(launcher, tmp_path):
    save(tmp_path / "other", [[1, 2, 3]], {"vocab_hash": "0" * 64})
    with pytest.raises(RuntimeError, match="another tokenizer"):
        launcher.start("verifier-other", "verifier", ["--model", TARGET_DIR, "--local-drafter",
                                                      "suffix:" + json.dumps({"suffix_decoding_datastore":
                                                                              str(tmp_path / "other")})])


def test_the_offline_engine_refuses_a_datastore_of_another_vocabulary(tmp_path):
    from specd.llm import LLM

    save(tmp_path / "other", [[1, 2, 3]], {"vocab_hash": "0" * 64})
    with pytest.raises(ValueError, match="another tokenizer"):
        LLM(TARGET_DIR, speculative_config={"method": "suffix", "suffix_decoding_datastore": str(tmp_path / "other")})
