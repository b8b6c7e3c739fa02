"""Parallel (PARD) drafting: a draft model with a mask token drafts a whole chain in one forward.

The reference is transformers' forward of the same weights on [history, k - 1 masks]: draft j
is the argmax of row j of the last k rows, whatever the batch and however the history arrived.
"""
from __future__ import annotations

import pytest
import torch

from drafter_helpers import parallel_copy
from specd.proposers.base import ProposeRequest
from specd.proposers.draft_model import DraftModelProposer

transformers = pytest.importorskip("transformers")
PARD = 5


@pytest.fixture(scope="module")
def parallel_dir(model_dirs, tmp_path_factory) -> str:
    return parallel_copy(model_dirs["llama3"], tmp_path_factory.mktemp("pard"), pard_token=PARD, parallel_drafts=4)


@pytest.fixture(scope="module")
def reference(parallel_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(parallel_dir, dtype=torch.float32).eval()


def _expected(model, history: list[int], k: int) -> list[int]:
    with torch.no_grad():
        logits = model(torch.tensor([history + [PARD] * (k - 1)])).logits[0, -k:]
    return logits.argmax(-1).tolist()


def _counting(proposer):
    calls = []
    run = proposer.runner.run
    proposer.runner.run = lambda entries: calls.append(len(entries)) or run(entries)
    return calls


def test_one_forward_drafts_the_chain_as_transformers_reads_it(parallel_dir, reference, make_prompts):
    proposer = DraftModelProposer(parallel_dir, dtype="float32")
    calls = _counting(proposer)
    prompts = make_prompts(5, seed=21, max_len=30)
    ks = [1, 2, 3, 4, 4]
    reqs = [ProposeRequest(seq_id=i, new_tokens=p, num_tokens=len(p), k=k, full_history=True)
            for i, (p, k) in enumerate(zip(prompts, ks))]
    props = proposer.propose(reqs)
    assert calls == [5]  # one forward for every chain of the batch, whatever k
    for p, k, prop in zip(prompts, ks, props):
        assert prop.token_ids == _expected(reference, p, k)
    # The masks were rolled back: the next call extends the committed history only.
    calls.clear()
    grown = [p + [7, 8] for p in prompts]
    props = proposer.propose([ProposeRequest(seq_id=i, new_tokens=[7, 8], num_tokens=len(g), k=3)
                              for i, g in enumerate(grown)])
    assert calls == [5]
    for g, prop in zip(grown, props):
        assert prop.token_ids == _expected(reference, g, 3)


def test_drafts_stop_at_what_the_drafter_was_trained_for(parallel_dir, reference, make_prompts):
    proposer = DraftModelProposer(parallel_dir, dtype="float32")
    (p,) = make_prompts(1, seed=22, max_len=20)
    (prop,) = proposer.propose([ProposeRequest(seq_id=0, new_tokens=p, num_tokens=len(p), k=8, full_history=True)])
    assert prop.token_ids == _expected(reference, p, 4)  # parallel_drafts = 4 in its config


def test_a_model_without_a_mask_token_drafts_one_forward_per_token(model_dirs, make_prompts):
    proposer = DraftModelProposer(model_dirs["llama3"], dtype="float32")
    calls = _counting(proposer)
    (p,) = make_prompts(1, seed=23, max_len=20)
    proposer.propose([ProposeRequest(seq_id=0, new_tokens=p, num_tokens=len(p), k=3, full_history=True)])
    assert calls == [1, 1, 1]
