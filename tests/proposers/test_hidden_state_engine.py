"""Hidden-state heads inside the offline engine: the engine captures the target's features in
its own forward and feeds them to the proposer. Greedy output (float32) must equal plain
decoding, and the heads must really draft (features arrive in the proposer's convention, so it
never asks for resync forever)."""
from __future__ import annotations

import pytest

from specd import SamplingParams

from head_layouts import head_target, write_layout

transformers = pytest.importorskip("transformers")
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return head_target(tmp_path_factory.mktemp("engine-target"))


@pytest.mark.parametrize("layout", ["eagle", "eagle3", "medusa_st", "mlp"])
def test_greedy_equals_plain_decoding_and_heads_draft(layout, target, get_llm, make_prompts, tmp_path):
    target_dir, model = target
    method, head_dir, _ = write_layout(layout, tmp_path / layout, model)
    prompts = make_prompts(6, seed=11, vocab=96, max_len=20)
    plain = [o.token_ids for o in get_llm(target_dir).generate(prompts, GREEDY)]
    spec = {"method": method, "model": str(head_dir), "target_model": target_dir, "num_speculative_tokens": 3,
            "adaptive": False}
    outs = get_llm(target_dir, fresh=True, speculative_config=spec).generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == plain
    assert sum(o.spec["draft_tokens"] for o in outs) > 0, "the head never drafted: features never arrived"
