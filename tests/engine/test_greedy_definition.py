"""One meaning of greedy (SamplingParams.greedy): a request with top_k=1 at temperature 0.7 is
verified, planned and drafted as greedy, through every drafter.

For each drafter (n-gram, suffix index, draft model drafting chains and token trees, an EAGLE head,
a sampling draft model), in process: the request's tokens equal a temperature-0 request's, every
ProposeRequest a drafter got for it says temperature 0 (what the wire carries to a drafter service:
drafter.proto's temperature), and the controller noted it as not sampling.
"""
from __future__ import annotations

import pytest
import torch
from head_layouts import write_layout

from specd import SamplingParams
from specd.engine.spec import offers as offers_module, speculator as speculator_module
from specd.models.demo_paths import demo_model_dir

transformers = pytest.importorskip("transformers")

TARGET, DRAFTER = str(demo_model_dir("target")), str(demo_model_dir("drafter"))
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n"


def _configs(tmp_path_factory) -> dict[str, dict]:
    model = transformers.AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    head = str(write_layout("eagle", tmp_path_factory.mktemp("eagle-greedy") / "eagle", model)[1])
    return {
        "ngram": {"method": "ngram", "prompt_lookup_min": 1},
        "suffix": {"method": "suffix"},
        "draft_model": {"method": "draft_model", "model": DRAFTER},
        "draft_model sampled": {"method": "draft_model", "model": DRAFTER, "draft_sample_method": "sampled"},
        "draft_model tree": {"method": "draft_model", "model": DRAFTER, "tree": {"branching": [2, 2], "max_nodes": 6}},
        "eagle": {"method": "eagle", "model": head, "target_model": TARGET},
    }


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    return _configs(tmp_path_factory)


@pytest.mark.parametrize("name", ["ngram", "suffix", "draft_model", "draft_model sampled", "draft_model tree", "eagle"])
def test_top_k_1_at_temperature_0_7_is_greedy_everywhere(configs, get_llm, monkeypatch, name):
    seen: list[float] = []
    real = speculator_module.ProposeRequest

    def recording(*args, **kwargs):
        seen.append(kwargs["temperature"])
        return real(*args, **kwargs)

    for module in (offers_module, speculator_module):  # the index drafters' offers, the other drafters' asks
        monkeypatch.setattr(module, "ProposeRequest", recording)
    cfg = {**configs[name], "num_speculative_tokens": 3, "adaptive": False}
    llm = get_llm(TARGET, fresh=True, speculative_config=cfg)
    ids = llm.tokenizer.encode(PROMPT)
    top1 = SamplingParams(temperature=0.7, top_k=1, max_tokens=24, ignore_eos=True)
    (got,) = llm.generate([{"prompt_token_ids": ids}], top1)
    asked = list(seen)
    (want,) = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert got.token_ids == want.token_ids
    assert asked and set(asked) == {0.0}, asked  # drafted as greedy
    assert got.spec["draft_tokens"] > 0
    assert not any(llm.engine.speculator.controller.sampled.values())  # planned as greedy
