"""A chain head's prefix cache (specd/proposers/heads/prefix_cache.py) and features_from.

Random-weight EAGLE and EAGLE-3 heads for a tiny Llama target, fed the target's own features
(base.py's convention). A history released by one sequence is kept; a new sequence sharing its
first 40 tokens, sent with its rows from pair 32 only, drafts what a fresh head drafts from all
of its rows; one whose rows start past what the head holds is answered resync with the pairs
held, and drafts once its rows start there. Parallel heads need only the last row. The cache
keeps to its byte budget.
"""
from __future__ import annotations

import pytest
import torch

from specd.proposers.base import ProposeRequest
from specd.proposers.hidden_state import HiddenStateProposer

from head_layouts import head_target, write_layout

K = 3


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return head_target(tmp_path_factory.mktemp("hpc-target"))


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    """layout -> (method, head dir), each written once."""
    root = tmp_path_factory.mktemp("hpc-heads")
    return {name: write_layout(name, root / name, target[1])[:2] for name in ("eagle", "eagle3", "medusa_st", "mlp")}


def _proposer(layout: str, target, heads, **kw) -> HiddenStateProposer:
    method, head_dir = heads[layout]
    return HiddenStateProposer(method, str(head_dir), target[0], num_speculative_tokens=K, dtype="float32",
                               device="cpu", **kw)


def _rows(model, tokens: list[int], layers) -> torch.Tensor:
    """[len(tokens) - 1, F]: row p is the target's state at position p (it predicted token p + 1)."""
    with torch.no_grad():
        hs = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    return torch.cat([hs[j][0] for j in layers], -1)[:-1]


def _full(proposer, model, seq_id: int, tokens: list[int], features_from: int = 0):
    rows = _rows(model, tokens, proposer.feature_layers)[features_from:]
    req = ProposeRequest(seq_id=seq_id, new_tokens=tokens, num_tokens=len(tokens), k=K, full_history=True,
                         features=rows, feature_layers=proposer.feature_layers, features_from=features_from)
    return proposer.propose([req])[0]


def _history(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 96, (n,), generator=g).tolist()


@pytest.mark.parametrize("layout", ["eagle", "eagle3"])
def test_a_released_history_serves_the_next_one_from_the_cache(layout, target, heads):
    model = target[1]
    shared = _history(1, 40)
    first, second = shared + _history(2, 20), shared + _history(3, 9)
    cached = _proposer(layout, target, heads)
    assert _full(cached, model, 1, first).token_ids
    cached.release([1])
    assert cached.prefix_cache.bytes > 0

    got = _full(cached, model, 2, second, features_from=32)  # rows of pairs 32.. only
    fresh = _full(_proposer(layout, target, heads, prefix_cache_mb=0), model, 9, second)
    assert not got.resync and got.token_ids == fresh.token_ids and len(got.token_ids) == K
    # The head now holds pairs 0..31 (two blocks whose pairs read tokens up to 32, all shared) and
    # ran only pairs 32..47 of the second history.
    assert cached.prefix_cache.pairs_reused == 32 and cached.seqs[2].kv.length == len(second) - 1

    # Rows starting past what is held: resync, with what is held; rows from there: drafts.
    third = shared[:20] + _history(4, 30)
    lacking = _full(cached, model, 3, third, features_from=32)
    assert lacking.resync and lacking.history_held == 16 and 3 not in cached.seqs
    again = _full(cached, model, 3, third, features_from=lacking.history_held)
    assert not again.resync and again.token_ids == _full(_proposer(layout, target, heads, prefix_cache_mb=0),
                                                         model, 9, third).token_ids
    stranger = _full(cached, model, 4, _history(5, 50), features_from=32)
    assert stranger.resync and stranger.history_held == 0


def test_the_cache_keeps_to_its_budget(target, heads):
    model = target[1]
    proposer = _proposer("eagle", target, heads, prefix_cache_mb=0.01)  # ~10 KB: a few blocks
    for sid in range(6):
        _full(proposer, model, sid, _history(10 + sid, 64))
        proposer.release([sid])
        assert 0 < proposer.prefix_cache.bytes <= 0.01 * 2**20
    # the latest history's blocks are the ones kept (least recently used go first)
    newest = _history(15, 64)
    assert proposer.prefix_cache.held(newest, 62)


@pytest.mark.parametrize("layout", ["medusa_st", "mlp"])
def test_parallel_heads_draft_from_the_last_row_whatever_features_from(layout, target, heads):
    model = target[1]
    history = _history(6, 50)
    proposer = _proposer(layout, target, heads)
    assert proposer.prefix_cache is None
    late = _full(proposer, model, 1, history, features_from=40)
    assert not late.resync and late.token_ids == _full(proposer, model, 2, history).token_ids
