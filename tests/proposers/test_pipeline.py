"""Pipelined drafting at the proposer (specd/proposers/pipeline.py): drafts taken from the draft
cache are the drafter's drafts for exactly that history, and drafting ahead never disturbs the
committed state. Real proposers on tiny random checkpoints, driven through simulated
verification outcomes (accept j drafts, then a token that the drafter guessed or did not)."""
from __future__ import annotations

import random

import pytest
import torch

from specd.proposers.base import ProposeRequest
from specd.proposers.draft_model import DraftModelProposer
from specd.proposers.pipeline import PipelinedProposer

from head_layouts import write_layout

transformers = pytest.importorskip("transformers")
K = 3


def _outcome(rng: random.Random, pipe: PipelinedProposer, drafts: list[int], vocab: int) -> list[int]:
    """The committed delta after verifying drafts: half the time one the drafter drafted ahead for."""
    entries = pipe.cache.get(1, [])
    if entries and rng.random() < 0.5:
        return list(rng.choice(entries).request.new_tokens)
    j = rng.randint(0, len(drafts))
    return drafts[:j] + [rng.randrange(3, vocab)]


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.8, 1234)])
def test_cached_drafts_equal_the_drafters_drafts_for_that_history(llama_dir, make_prompts, temperature, seed):
    """draft_model, greedy and seeded sampling: a cache hit returns the very drafts (and q) that
    proposing synchronously after the same history returns; both hits and misses happen."""
    opts = dict(dtype="float32", device="cpu", sample_method="sampled", seed=5)
    pipe = PipelinedProposer(DraftModelProposer(llama_dir, **opts))
    ref = DraftModelProposer(llama_dir, **opts)
    rng = random.Random(7)
    history = make_prompts(1, seed=3, max_len=12)[0]
    req = ProposeRequest(seq_id=1, new_tokens=list(history), num_tokens=len(history), k=K, full_history=True,
                         temperature=temperature, seed=seed)
    for _ in range(40):
        got, want = pipe.propose([req])[0], ref.propose([req])[0]
        assert got.token_ids == want.token_ids
        assert got.q_ids == want.q_ids
        if want.q_probs:
            assert [p for row in got.q_probs for p in row] == pytest.approx(
                [p for row in want.q_probs for p in row], rel=1e-5)
        assert got.draft_probs is None and got.draft_features is None  # records stay in the cache
        pipe.predraft()
        delta = _outcome(rng, pipe, got.token_ids, 96)
        req = ProposeRequest(seq_id=1, new_tokens=delta, num_tokens=req.num_tokens + len(delta), k=K,
                             temperature=temperature, seed=seed)
    assert pipe.hits >= 10 and pipe.misses >= 5, (pipe.hits, pipe.misses)


def test_bonus_outcome_is_drafted_ahead(llama_dir, make_prompts):
    """All drafts accepted: the drafter guesses the bonus token as its own next draft; when the
    target agrees (here it is the drafter itself), the next step is a hit."""
    pipe = PipelinedProposer(DraftModelProposer(llama_dir, dtype="float32", device="cpu"))
    history = make_prompts(1, seed=4, max_len=10)[0]
    p = pipe.propose([ProposeRequest(1, list(history), len(history), K, full_history=True)])[0]
    pipe.predraft()
    # what the drafter itself would say after its drafts: the bonus a self-verifier commits
    solo = DraftModelProposer(llama_dir, dtype="float32", device="cpu")
    bonus = solo.propose([ProposeRequest(1, list(history) + p.token_ids, len(history) + K, 1, full_history=True)])
    delta = p.token_ids + bonus[0].token_ids
    hit = pipe.propose([ProposeRequest(1, delta, len(history) + len(delta), K)])[0]
    assert hit.cached and len(hit.token_ids) == K


def test_eagle_drafting_ahead_leaves_the_committed_state_exact(tmp_path, make_prompts):
    """EAGLE drafts ahead from its own predicted states; the next real request brings the
    target's (as the drafter service builds requests: features, no layer names). Whatever was drafted ahead, every miss proposes what a proposer that never
    pipelined proposes from the same committed tokens and features."""
    from specd.proposers.hidden_state import HiddenStateProposer

    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    target = transformers.LlamaForCausalLM(cfg).eval()
    target.save_pretrained(tmp_path / "target")
    method, head, _ = write_layout("eagle", tmp_path / "head", target)
    make = lambda: HiddenStateProposer(method, str(head), str(tmp_path / "target"), dtype="float32", device="cpu")
    pipe, ref = PipelinedProposer(make()), make()
    table = torch.randn(256, 32, generator=torch.Generator().manual_seed(1))  # "the target's" row per position
    rng = random.Random(2)
    tokens = make_prompts(1, seed=5, vocab=96, max_len=10)[0]
    req = ProposeRequest(1, list(tokens), len(tokens), K, full_history=True, features=table[:len(tokens) - 1])
    compared = 0
    for _ in range(30):
        got, want = pipe.propose([req])[0], ref.propose([req])[0]
        if not got.cached:
            assert got.token_ids == want.token_ids
            compared += 1
        pipe.predraft()
        delta = _outcome(rng, pipe, got.token_ids, 96)
        start = req.num_tokens
        req = ProposeRequest(1, delta, start + len(delta), K, features=table[start - 1:start - 1 + len(delta)])
    assert pipe.hits >= 5 and compared >= 5, (pipe.hits, compared)


def test_only_chain_proposers_draft_ahead(llama_dir):
    with pytest.raises(ValueError, match="cannot draft ahead"):
        PipelinedProposer(DraftModelProposer(llama_dir, dtype="float32", device="cpu", tree_branching=[2, 1]))
