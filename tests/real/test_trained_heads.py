"""The trained heads committed for the default target (models/SmolLM2-135M-Instruct-<method>):
`specd drafter --method M` finds each one without --model, each loads against the fetched
target (its config names the fingerprint of exactly those weights, which the proposer and the
verifier check), and speculating with it in float32 gives plain decoding's greedy tokens while
its drafts are accepted."""
from __future__ import annotations

import argparse

import pytest
import torch

from specd import LLM, SamplingParams

from specd.models import model_store
from specd.models.chat import chat_prompt_ids

pytestmark = pytest.mark.timeout(1200)
METHODS = ["eagle", "eagle3", "medusa", "mlp_speculator"]
QUESTIONS = ["What is the capital of France?", "Give me three tips for staying focused while studying."]


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    return str(model_store.fetch()[0])


@pytest.fixture(scope="module")
def prompts_and_plain(target):
    llm = LLM(target, dtype="float32")
    prompts = [{"prompt_token_ids": chat_prompt_ids(llm.tokenizer, [{"role": "user", "content": q}])}
               for q in QUESTIONS]
    plain = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0))]
    return prompts, plain


@pytest.mark.parametrize("method", METHODS)
def test_committed_head_is_the_default_and_lossless(target, prompts_and_plain, method):
    from services.drafter.main import _with_defaults

    options = _with_defaults({}, method, argparse.Namespace(target=None, dtype=None))
    assert options["model"] == str(model_store.committed_head_dir(method))
    prompts, plain = prompts_and_plain
    spec = LLM(target, dtype="float32", speculative_config={
        "method": method, "model": options["model"], "target_model": target, "num_speculative_tokens": 4,
        "adaptive": False})
    outs = spec.generate(prompts, SamplingParams(max_tokens=32, temperature=0))
    assert [o.token_ids for o in outs] == plain
    drafted = sum(o.spec["draft_tokens"] for o in outs)
    assert drafted and sum(o.spec["accepted_tokens"] for o in outs) > 0
