"""Top-n logprobs from the engine: each emitted token's alternatives come from the target's
raw logits at that token's own position, with speculation (several tokens per step) or
without, for every request of a mixed batch — checked against transformers' log_softmax."""
from __future__ import annotations

import pytest
import torch

from specd import SamplingParams

TOL = 1e-4
SPEC = {
    "off": None,
    # The target drafting for itself: every draft is accepted, so 5 tokens commit per step.
    "self": lambda target: {"method": "draft_model", "model": target, "num_speculative_tokens": 4,
                            "adaptive": False},
    "ngram": lambda target: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                             "prompt_lookup_max": 3},
}
PARAMS = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=5),
          SamplingParams(max_tokens=16, temperature=0.9, seed=3, ignore_eos=True, logprobs=20),
          SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=True),  # chosen tokens only
          SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)]  # no logprobs


@pytest.mark.parametrize("spec", list(SPEC))
def test_top_logprobs_follow_each_position(spec, model_dirs, get_llm, make_prompts, hf_logits):
    target = model_dirs["llama3"]
    cfg = SPEC[spec](target) if SPEC[spec] else None
    llm = get_llm(target, fresh=True, speculative_config=cfg) if cfg else get_llm(target)
    prompts = [p * 2 for p in make_prompts(4, seed=31, max_len=20)]  # repeats: ngram finds drafts
    outs = llm.generate(prompts, PARAMS)
    assert outs[2].logprobs is not None and outs[2].top_logprobs is None
    assert outs[3].logprobs is None and outs[3].top_logprobs is None
    if cfg:
        assert sum(o.spec["accepted_tokens"] for o in outs) > 0, "no multi-token step: the test would prove nothing"
    for p, o, sp in zip(prompts, outs[:2], PARAMS):
        n = sp.logprobs
        rows = torch.log_softmax(hf_logits(target, p + o.token_ids).double(), -1)[len(p) - 1:-1]
        assert len(o.top_logprobs) == len(o.logprobs) == len(o.token_ids) == 16
        for i, (token, logprob, top) in enumerate(zip(o.token_ids, o.logprobs, o.top_logprobs)):
            values = [v for _, v in top]
            assert len(top) == n and values == sorted(values, reverse=True)
            assert max(abs(a - b) for a, b in zip(values, rows[i].topk(n).values.tolist())) <= TOL, (i, values)
            assert all(abs(rows[i, t].item() - v) <= TOL for t, v in top), i
            assert abs(rows[i, token].item() - logprob) <= TOL, i
            ids = [t for t, _ in top]
            if token in ids:  # the chosen token carries exactly the same logprob among the alternatives
                assert top[ids.index(token)] == (token, logprob)
            if sp.temperature == 0:
                assert top[0] == (token, logprob)
