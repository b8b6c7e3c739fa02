"""Structured output in the engine: lossless with speculation.

A tiny Llama whose 16 tokens are the letters a-m (ids 3-15; a byte-level tokenizer llguidance
reads) and a perturbed copy as drafter. Sampling: the emitted (token 1, token 2) pairs under a
grammar follow the masked target distribution, computed exactly from transformers' forward,
with drafts that the grammar often refuses, and with drafts the drafter masked itself (chi-square). Greedy: every method gives plain
decoding's tokens under the grammar, and every output matches it.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from chi2 import chi2_critical
from letters_model import make_letters_pair
from specd import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("llguidance")

REGEX = "[a-d][e-h][a-m]"  # three letters, then EOS


@pytest.fixture(scope="module")
def letters_pair(tmp_path_factory):
    return make_letters_pair(tmp_path_factory)


def _masked(logits: torch.Tensor, allowed: range) -> torch.Tensor:
    keep = torch.full_like(logits, float("-inf"))
    keep[list(allowed)] = 0
    return (logits + keep).softmax(-1)


def _exact_pair_distribution(model, prompt: list[int]) -> torch.Tensor:
    """P(t1, t2) under REGEX: t1 in a-d (ids 3-6), t2 in e-h (ids 7-10), each step's softmax masked."""
    with torch.no_grad():
        p1 = _masked(model(torch.tensor([prompt])).logits[0, -1], range(3, 7))
        logits2 = model(torch.tensor([prompt + [t] for t in range(3, 7)])).logits[:, -1]
    p2 = torch.stack([_masked(row, range(7, 11)) for row in logits2])  # [4 (t1), 16]
    return p1[3:7, None] * p2[:, 7:11]  # [4, 4]


SAMPLED = {
    # the drafter's own sampled drafts (sparse q): refused ones must be rejected against q's residual
    "draft_model_sampled": lambda drafter: {"method": "draft_model", "model": drafter, "num_speculative_tokens": 2,
                                            "adaptive": False, "draft_sample_method": "sampled", "draft_top_k": 8,
                                            "draft_structured_outputs": False},
    # the same drafter masking its drafts with the grammar: q is the masked draft distribution
    "draft_model_sampled_masked": lambda drafter: {"method": "draft_model", "model": drafter,
                                                   "num_speculative_tokens": 2, "adaptive": False,
                                                   "draft_sample_method": "sampled", "draft_top_k": 8},
    # one-hot drafts from the prompt (it repeats letters the grammar refuses at most positions)
    "ngram": lambda drafter: {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
                              "adaptive": False},
}


@pytest.mark.parametrize("method", sorted(SAMPLED))
def test_constrained_samples_follow_the_masked_target_distribution(method, letters_pair, get_llm):
    target, drafter, hf_model = letters_pair
    prompt = [1, 5, 9, 14, 5, 9, 14, 5, 9]
    n = 8_000
    llm = get_llm(target, fresh=True, max_num_seqs=256, speculative_config=SAMPLED[method](drafter))
    outs = llm.generate([prompt] * n, [SamplingParams(max_tokens=4, temperature=1.0, seed=i,
                                                      structured_outputs={"regex": REGEX}) for i in range(n)])
    assert all(re.fullmatch(REGEX, o.text) for o in outs), [o.text for o in outs if not re.fullmatch(REGEX, o.text)][:5]
    # speculation ran (256 in flight: each request drafts at token 2; at 1024, the token budget
    # leaves most without drafts there, and the test would see little of them)
    assert sum(o.spec["draft_tokens"] for o in outs) > n
    counts = torch.zeros(4, 4, dtype=torch.float64)
    for o in outs:
        counts[o.token_ids[0] - 3, o.token_ids[1] - 7] += 1
    expected = _exact_pair_distribution(hf_model, prompt).double() * n
    keep = expected > 5
    stat = (((counts[keep] - expected[keep]) ** 2) / expected[keep]).sum().item()
    rest_e, rest_c = expected[~keep].sum().item(), counts[~keep].sum().item()
    if rest_e > 0:
        stat += (rest_c - rest_e) ** 2 / rest_e
    df = int(keep.sum()) + (1 if rest_e > 0 else 0) - 1
    assert stat < chi2_critical(df), f"chi2 {stat:.1f} >= {chi2_critical(df):.1f} with {df} df"


GREEDY_METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 4},
    "draft_model_tree": {"method": "draft_model", "num_speculative_tokens": 3,
                         "tree": {"branching": [2, 2, 1], "dynamic": False, "max_nodes": 8}},
}


@pytest.mark.parametrize("method", sorted(GREEDY_METHODS))
def test_greedy_under_a_grammar_is_plain_decoding(method, letters_pair, get_llm, make_prompts):
    target, drafter, _ = letters_pair
    grammar = "([a-d][e-h])+m"  # pairs until an m, or max_tokens
    prompts = make_prompts(12, seed=4, vocab=16, max_len=20)
    params = SamplingParams(max_tokens=20, temperature=0, structured_outputs={"regex": grammar})
    plain = get_llm(target, fresh=True).generate(prompts, params)
    cfg = dict(GREEDY_METHODS[method], adaptive=False)
    if cfg["method"] == "draft_model":
        cfg["model"] = drafter
    outs = get_llm(target, fresh=True, speculative_config=cfg).generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert sum(o.spec["draft_tokens"] for o in outs) > 0
    for o in plain:  # a prefix of the language (max_tokens may cut it), whole where it ended on EOS
        assert re.fullmatch("([a-d][e-h])*[a-d]?" if o.finish_reason == "length" else grammar, o.text), o.text


def test_a_bad_grammar_is_a_clear_error(letters_pair, get_llm):
    llm = get_llm(letters_pair[0])
    with pytest.raises(ValueError, match="structured"):
        llm.generate([[1, 5]], SamplingParams(max_tokens=4, structured_outputs={"regex": "[a-"}))
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["a"]})


# -- the peers' bugs (vLLM #44006, #36138; TRT-LLM #7878), as tests -------------------------------

def _grammars(target):
    from specd.engine.grammar import Grammars

    return Grammars(Path(target) / "tokenizer.json", 16, [2])


def test_every_verify_row_is_masked_the_bonus_row_included(letters_pair):
    """A chain of 3 allowed drafts: rows 0-3 (the bonus row last) each hold the grammar's state
    after the drafts before it; row 2 of a second sequence whose draft 1 is refused is left alone."""
    from specd.engine.llm_engine import StepTimings
    from specd.engine.scheduler import Drafts, ScheduledSeq
    from specd.engine.sequence import Sequence
    from specd.structured import StructuredOutput

    grammars = _grammars(letters_pair[0])
    structured = StructuredOutput(regex="[a-d][e-h][a-m]")
    batch = []
    for drafts in ([3, 8, 12], [4, 4]):  # a e j (allowed, then EOS only) / b b (b refused at position 2)
        seq = Sequence([1, 5], SamplingParams(structured_outputs=structured))
        seq.matcher = grammars.matcher(structured)
        kept = grammars.cut_drafts(seq.matcher, drafts, None)
        batch.append(ScheduledSeq(seq, 1 + len(kept), 1 + len(kept), Drafts([drafts[i] for i in kept])))
    assert [len(e.draft_token_ids) for e in batch] == [3, 2]  # the refused token stays, nothing after it
    logits = torch.zeros(4 + 3, 16)
    grammars.mask_batch(batch, logits, StepTimings())
    allowed = [set((row > -1).nonzero().flatten().tolist()) for row in logits]
    assert allowed[:4] == [set(range(3, 7)), set(range(7, 11)), set(range(3, 16)), {2}]  # bonus row: EOS only
    assert allowed[4:6] == [set(range(3, 7)), set(range(7, 11))]
    assert allowed[6] == set(range(16))  # after the refused b: never read, not masked


@pytest.mark.parametrize("method", ["ngram", "draft_model_self"])
def test_the_end_of_the_grammar_inside_the_draft_window_ends_where_plain_does(method, letters_pair, get_llm,
                                                                              make_prompts):
    """`choice` answers are 1-2 tokens, k = 6: every draft window runs past the grammar's end
    (drafts from the prompt, or from the target itself without the grammar); the output stops at
    the same token with the same finish reason as plain decoding, and no refused draft is emitted."""
    target = letters_pair[0]
    params = SamplingParams(max_tokens=12, temperature=0, structured_outputs={"choice": ["ab", "cdm", "e"]})
    prompts = [p * 3 for p in make_prompts(10, seed=9, vocab=16, max_len=6)]
    plain = get_llm(target, fresh=True).generate(prompts, params)
    cfg = ({"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1, "adaptive": False}
           if method == "ngram" else
           {"method": "draft_model", "model": target, "num_speculative_tokens": 6, "adaptive": False,
            "draft_structured_outputs": False})
    outs = get_llm(target, fresh=True, speculative_config=cfg).generate(prompts, params)
    assert [(o.token_ids, o.finish_reason) for o in outs] == [(o.token_ids, o.finish_reason) for o in plain]
    assert all(o.text in ("ab", "cdm", "e") and o.finish_reason == "stop" for o in outs)
    assert sum(o.spec["draft_tokens"] for o in outs) > 0
