"""Drafter-side structured output: model drafters mask their own drafts with the request's grammar.

On the letters model (tests/letters_model.py) under a grammar a random drafter does not know:
the proposer's drafts stay inside the grammar with masking and leave it without; in the engine,
greedy output is plain decoding's either way and masking raises the accepted tokens.
"""
from __future__ import annotations

import json

import pytest

from head_layouts import write_layout
from letters_model import make_letters_pair
from specd import SamplingParams

pytest.importorskip("transformers")
pytest.importorskip("llguidance")

GRAMMAR = "([a-d][e-h])+m"  # pairs of letters until an m


@pytest.fixture(scope="module")
def letters_pair(tmp_path_factory):
    return make_letters_pair(tmp_path_factory)


def _structured() -> str:
    from specd.structured import StructuredOutput

    return json.dumps(StructuredOutput(regex=GRAMMAR).to_dict())


def _valid_prefix(target: str, answer: list[int], drafts: list[int]) -> int:
    """How many of drafts the grammar allows after answer."""
    from pathlib import Path

    from specd.engine.grammar import Grammars
    from specd.structured import StructuredOutput

    matcher = Grammars(Path(target) / "tokenizer.json", 16, [2]).matcher(StructuredOutput(regex=GRAMMAR))
    assert matcher.consume_tokens(answer)
    return matcher.validate_tokens(drafts)


@pytest.mark.parametrize("mask", [True, False])
def test_a_draft_model_drafts_inside_the_grammar_only_when_it_masks(mask, letters_pair, make_prompts):
    from specd.proposers.base import ProposeRequest
    from specd.proposers.draft_model import DraftModelProposer

    target = letters_pair[0]
    proposer = DraftModelProposer(target, dtype="float32", mask_structured=mask)
    prompts = make_prompts(16, seed=21, vocab=16, max_len=12)
    answer = [3, 7]  # "ae": one pair in, the grammar wants [a-d] or m next
    reqs = [ProposeRequest(seq_id=i, new_tokens=p + answer, num_tokens=len(p) + 2, k=6, full_history=True,
                           num_prompt_tokens=len(p), structured_outputs=_structured())
            for i, p in enumerate(prompts)]
    first = proposer.propose(reqs)
    valid = [_valid_prefix(target, answer, p.token_ids) for p in first]
    if mask:
        # every draft allowed; a chain that drafted the grammar's end (m, EOS) stops there
        assert all(v == len(p.token_ids) > 0 for v, p in zip(valid, first)), [(v, p.token_ids) for v, p in zip(valid, first)]
        assert all(len(p.token_ids) == 6 or p.token_ids[-1] == 2 for p in first)
    else:
        assert sum(v < len(p.token_ids) for v, p in zip(valid, first)) >= 8, valid  # most leave the grammar
    if not mask:
        return
    # The next call sends only what was committed since ("bf", no draft accepted): the matcher
    # follows committed tokens and held none of the drafts (else "bf" would not fit after them).
    second = [ProposeRequest(seq_id=r.seq_id, new_tokens=[4, 8], num_tokens=r.num_tokens + 2, k=4,
                             num_prompt_tokens=r.num_prompt_tokens) for r in reqs]
    for p in proposer.propose(second):
        assert _valid_prefix(target, answer + [4, 8], p.token_ids) == len(p.token_ids) > 0
        assert len(p.token_ids) == 4 or p.token_ids[-1] == 2


def _spec(method: str, letters_pair, tmp_path) -> dict:
    target, drafter, model = letters_pair
    if method == "draft_model":
        spec = {"method": "draft_model", "model": drafter}
    else:
        kind, head_dir, _ = write_layout(method, tmp_path / method, model)
        spec = {"method": kind, "model": str(head_dir), "target_model": target}
    return {**spec, "num_speculative_tokens": 4, "adaptive": False}


@pytest.mark.parametrize("method", ["draft_model", "eagle", "medusa_st"])
def test_masking_drafters_keep_greedy_exact_and_get_more_accepted(method, letters_pair, get_llm, make_prompts,
                                                                  tmp_path):
    target = letters_pair[0]
    prompts = make_prompts(12, seed=4, vocab=16, max_len=20)
    params = SamplingParams(max_tokens=24, temperature=0, structured_outputs={"regex": GRAMMAR})
    plain = [o.token_ids for o in get_llm(target, fresh=True).generate(prompts, params)]
    accepted, spec = {}, _spec(method, letters_pair, tmp_path)
    for mask in (False, True):
        outs = get_llm(target, fresh=True, speculative_config={**spec, "draft_structured_outputs": mask}).generate(
            prompts, params)
        assert [o.token_ids for o in outs] == plain
        accepted[mask] = sum(o.spec["accepted_tokens"] for o in outs)
    assert accepted[True] > accepted[False], accepted
