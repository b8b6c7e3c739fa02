"""Penalties, logit_bias and min_tokens over real HTTP with the official client (issue 69).

The demo target (float32) behind a verifier with every kind of drafter: a draft model drafting
chains, the same drafting token trees, an n-gram service, an EAGLE head (random weights in the
published layout, written for this target), and the suffix index inside the verifier. For each
setting, greedy:
- with speculation off, the output equals plain decoding by transformers on the same weights with
  its logits processors (RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor,
  MinNewTokensLengthLogitsProcessor) and OpenAI's presence / frequency definitions;
- with each drafter at k = 3, the output is the same again (the penalties count the drafts before
  each verify row).
"""
from __future__ import annotations

import json
import time

import openai
import pytest
import torch
from head_layouts import write_layout

from specd.models.demo_paths import demo_model_dir
from specd.models.tokenizer import Tokenizer
from specd.v1 import verifier_pb2 as pb
from specd.v1 import verifier_pb2_grpc as pbg

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(900)

TARGET, DRAFTER = str(demo_model_dir("target")), str(demo_model_dir("drafter"))
PROMPTS = ["def fibonacci(n):\n    ", "class Parser:\n    def __init__(self"]
TOKENS = 24
SETTINGS = {
    "frequency": dict(frequency_penalty=1.5),
    "presence": dict(presence_penalty=-1.0),
    "repetition": dict(extra_body={"repetition_penalty": 1.5}),
    "logit_bias": dict(logit_bias={"40": 6.0, "41": 4.5, "1": -100}),
    "min_tokens": dict(extra_body={"min_tokens": TOKENS}),
    "all": dict(frequency_penalty=0.5, presence_penalty=0.25, logit_bias={"40": 3.0},
                extra_body={"repetition_penalty": 1.25, "min_tokens": 8}),
}
DRAFTERS = ["chain", "tree", "ngram", "eagle", "suffix"]


class OpenAIPenalties(transformers.LogitsProcessor):
    """OpenAI's frequency and presence penalties over the generated tokens (transformers has none)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float):
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids, scores):
        for row, ids in zip(scores, input_ids):
            counts = torch.bincount(ids[self.prompt_len:], minlength=scores.shape[-1]).to(scores.dtype)
            row -= self.frequency * counts + self.presence * (counts > 0).to(scores.dtype)
        return scores


def reference(model, ids: list[int], setting: dict, eos: int) -> list[int]:
    """Greedy plain decoding by transformers with the setting's processors, in vLLM's order."""
    extra = setting.get("extra_body", {})
    processors = transformers.LogitsProcessorList()
    if extra.get("min_tokens"):
        processors.append(transformers.MinNewTokensLengthLogitsProcessor(len(ids), extra["min_tokens"], eos))
    if setting.get("logit_bias"):
        processors.append(transformers.SequenceBiasLogitsProcessor(
            {(int(t),): float(b) for t, b in setting["logit_bias"].items()}))
    if extra.get("repetition_penalty"):
        processors.append(transformers.RepetitionPenaltyLogitsProcessor(extra["repetition_penalty"]))
    if setting.get("frequency_penalty") or setting.get("presence_penalty"):
        processors.append(OpenAIPenalties(len(ids), setting.get("frequency_penalty", 0.0),
                                          setting.get("presence_penalty", 0.0)))
    out = model.generate(torch.tensor([ids]), max_new_tokens=TOKENS, do_sample=False, logits_processor=processors,
                         eos_token_id=eos, pad_token_id=eos)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def stack(launcher, tmp_path_factory):
    model = transformers.AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    head = str(write_layout("eagle", tmp_path_factory.mktemp("eagle-head") / "eagle", model)[1])
    common = ["--dtype", "float32", "--log-level", "warning"]
    drafters = {
        "chain": launcher.start("chain", "drafter", ["--method", "draft_model", "--name", "chain", "--model", DRAFTER,
                                                     *common]),
        "tree": launcher.start("tree", "drafter", ["--method", "draft_model", "--name", "tree", "--model", DRAFTER,
                                                   "--options", json.dumps({"tree": {"branching": [3, 2, 1],
                                                                                     "max_nodes": 12}}), *common]),
        "ngram": launcher.start("ngram", "drafter", ["--method", "ngram", "--name", "ngram", "--options",
                                                     json.dumps({"prompt_lookup_min": 1}), *common]),
        "eagle": launcher.start("eagle", "drafter", ["--method", "eagle", "--name", "eagle", "--model", head,
                                                     "--target", TARGET, *common]),
    }
    verifier = launcher.start("verifier", "verifier", [
        "--model", TARGET, *common, "--propose-timeout-ms", "5000", "--local-drafter", "suffix",
        "--speculative-config", json.dumps({"adaptive": False}),  # drafts every step, however loaded
        *[a for name, d in drafters.items() for a in ("--drafter", f"{name}={d.address}")]])
    gateway = launcher.start("gateway", "gateway", ["--verifier", verifier.address], http=True)
    stub = pbg.VerifierStub(__import__("grpc").insecure_channel(verifier.address))
    deadline = time.monotonic() + 120
    while sum(d.healthy for d in stub.ListDrafters(pb.ListDraftersRequest(), timeout=10).drafters) < len(DRAFTERS):
        assert time.monotonic() < deadline, "the drafters never became healthy"
        time.sleep(0.2)
    client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="x", max_retries=0, timeout=300)
    return client, client.models.list().data[0].id, model, stub


def _complete(client, model_name, ids, setting, speculative) -> list[int]:
    extra = {**setting.get("extra_body", {}), "speculative": speculative}
    kw = {k: v for k, v in setting.items() if k != "extra_body"}
    r = client.completions.create(model=model_name, prompt=ids, max_tokens=TOKENS, temperature=0, logprobs=0,
                                  extra_body=extra, **kw)
    return r.choices[0].logprobs.tokens, r.usage.completion_tokens


@pytest.mark.parametrize("name", list(SETTINGS))
def test_penalties_equal_transformers_and_every_drafter(stack, name):
    client, model_name, model, stub = stack
    tok = Tokenizer.from_dir(TARGET)
    eos = json.loads((demo_model_dir("target") / "generation_config.json").read_text())["eos_token_id"]
    setting = SETTINGS[name]
    for text in PROMPTS:
        ids = tok.encode(text)
        want = reference(model, ids, setting, eos)
        want_strs = [tok.decode([t], skip_special_tokens=False) for t in want if t != eos]
        plain, n = _complete(client, model_name, ids, setting, {"num_speculative_tokens": 0})
        assert plain == want_strs and n == len(want), (name, text)
        for drafter in DRAFTERS:
            got, _ = _complete(client, model_name, ids, setting, {"num_speculative_tokens": 3, "drafter": drafter})
            assert got == plain, (name, text, drafter)
    drafted = {d.name: d.draft_tokens for d in stub.ListDrafters(pb.ListDraftersRequest(), timeout=10).drafters}
    assert all(drafted.get(d, 0) > 0 for d in DRAFTERS if d != "suffix"), drafted
