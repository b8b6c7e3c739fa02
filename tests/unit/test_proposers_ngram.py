"""ngram (prompt lookup) proposer: vLLM's matching rule, its keys, and the incremental
index against brute-force references on random token streams."""
from __future__ import annotations

import random

import pytest

from specd.proposers.base import ProposeRequest
from specd.proposers.ngram import NgramProposer


def full(seq_id: int, tokens: list[int], k: int) -> ProposeRequest:
    return ProposeRequest(seq_id, list(tokens), len(tokens), k, full_history=True)


def propose_once(tokens: list[int], k: int = 4, **keys) -> list[int]:
    p = NgramProposer(num_speculative_tokens=32, **keys)
    (prop,) = p.propose([full(0, tokens, k)])
    assert not prop.resync and prop.q_ids is None and prop.q_probs is None
    return prop.token_ids


def brute_force(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """The rule stated plainly: longest n in [lo, hi] whose suffix n-gram occurs earlier;
    the earliest occurrence; the tokens that followed it, cut at the end of the context."""
    size = len(tokens)
    for n in range(hi, lo - 1, -1):
        if n >= size:
            continue
        pattern = tokens[size - n:]
        for start in range(size - n):  # start + n <= size - 1: at least one token follows
            if tokens[start: start + n] == pattern:
                return tokens[start + n: start + n + k]
    return []


def vllm_style_kmp(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """vLLM's current algorithm re-derived: KMP over the reversed context, the border array
    kept for the first `hi` positions only; ties in length go to the position latest in the
    reversed context (earliest in the original)."""
    size = len(tokens)
    if size < lo:
        return []
    rev = tokens[::-1]
    border = [0] * hi
    longest, position, matched, i = 0, 0, 0, 1
    while i < size:
        if rev[matched] == rev[i]:
            matched += 1
            if matched >= longest:
                longest, position = matched, i
            if i < hi:
                border[i] = matched
            if matched == hi:
                matched = border[hi - 1]
            i += 1
        elif matched:
            matched = border[matched - 1]
        else:
            i += 1
    if longest < lo:
        return []
    start = size - 1 - position + longest
    return tokens[start: start + k]


def test_longest_match_wins_and_proposes_what_followed():
    # "7 8 9" occurs earlier followed by 1 2; "8 9" alone also occurs followed by 5.
    tokens = [8, 9, 5, 5, 7, 8, 9, 1, 2, 3, 0, 7, 8, 9]
    assert propose_once(tokens, k=3, prompt_lookup_min=1, prompt_lookup_max=3) == [1, 2, 3]
    # capped at n = 2: "8 9" first occurs at the start, followed by 5 5 7
    assert propose_once(tokens, k=3, prompt_lookup_min=1, prompt_lookup_max=2) == [5, 5, 7]


def test_earliest_occurrence_among_equal_matches_as_vllm():
    tokens = [1, 2, 10, 11, 1, 2, 20, 21, 1, 2]
    assert propose_once(tokens, k=2, prompt_lookup_min=2, prompt_lookup_max=2) == [10, 11]


def test_min_max_and_k_respected():
    tokens = [4, 5, 6, 7, 8, 9, 0, 6]  # only a 1-gram ("6") repeats
    assert propose_once(tokens, k=3, prompt_lookup_min=2, prompt_lookup_max=4) == []
    assert propose_once(tokens, k=3, prompt_lookup_min=1, prompt_lookup_max=4) == [7, 8, 9]
    assert propose_once(tokens, k=1, prompt_lookup_min=1, prompt_lookup_max=4) == [7]
    assert propose_once(tokens, k=0, prompt_lookup_min=1, prompt_lookup_max=4) == []
    # drafts are cut at the end of the context
    assert propose_once([3, 1, 2, 3], k=8, prompt_lookup_min=1, prompt_lookup_max=1) == [1, 2, 3]
    # the request's k is capped by num_speculative_tokens
    p = NgramProposer(num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=1)
    assert p.propose([full(0, tokens, 5)])[0].token_ids == [7, 8]


def test_no_match_no_drafts():
    assert propose_once(list(range(50)), k=4, prompt_lookup_min=1, prompt_lookup_max=3) == []
    assert propose_once([], k=4, prompt_lookup_min=1, prompt_lookup_max=3) == []
    assert propose_once([5], k=4, prompt_lookup_min=1, prompt_lookup_max=3) == []


def test_vllm_defaults_and_validation():
    assert (NgramProposer().min_n, NgramProposer().max_n) == (5, 5)
    p = NgramProposer(prompt_lookup_max=3)
    assert (p.min_n, p.max_n) == (3, 3)
    p = NgramProposer(prompt_lookup_min=2)
    assert (p.min_n, p.max_n) == (2, 2)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(prompt_lookup_min=4, prompt_lookup_max=2)
    with pytest.raises(TypeError, match="prompt_lookup_mn"):
        NgramProposer(prompt_lookup_mn=2)
    NgramProposer(suffix_decoding_max_tree_depth=24)  # another method's key: accepted, unused


def test_incremental_proposals_track_committed_tokens():
    p = NgramProposer(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=3)
    history = [1, 2, 3, 4, 9, 9]
    assert p.propose([full(7, history, 4)])[0].token_ids == []
    for tok, expected in [(1, []), (2, [3, 4, 9, 9]), (3, [4, 9, 9, 1])]:
        history.append(tok)
        (prop,) = p.propose([ProposeRequest(7, [tok], len(history), 4)])
        assert prop.token_ids == expected
    # an empty delta (nothing accepted since last time) proposes the same again: drafts never enter state
    assert p.propose([ProposeRequest(7, [], len(history), 4)])[0].token_ids == [4, 9, 9, 1]


@pytest.mark.parametrize("seed", range(6))
def test_incremental_index_matches_brute_force_on_random_streams(seed):
    rng = random.Random(seed)
    for _ in range(6):
        lo = rng.randint(1, 4)
        hi = rng.randint(lo, 6)
        vocab = rng.randint(2, 6)
        p = NgramProposer(num_speculative_tokens=8, prompt_lookup_min=lo, prompt_lookup_max=hi)
        history: list[int] = []
        for step in range(120):
            roll = rng.random()
            if roll < 0.05 and history:  # the caller rolls committed history back
                history = history[: rng.randint(0, len(history))]
                req = full(1, history, rng.randint(0, 8))
            elif roll < 0.08:  # a full resend of the same (or an extended) history
                history = history + [rng.randrange(vocab) for _ in range(rng.randint(0, 3))]
                req = full(1, history, rng.randint(0, 8))
            else:
                delta = [rng.randrange(vocab) for _ in range(rng.randint(0 if step else 1, 4))]
                history = history + delta
                req = ProposeRequest(1, delta, len(history), rng.randint(0, 8), full_history=step == 0)
            (prop,) = p.propose([req])
            expected = brute_force(history, lo, hi, min(req.k, 8))
            assert prop.token_ids == expected, (seed, lo, hi, history)
            assert vllm_style_kmp(history, lo, hi, min(req.k, 8)) == expected


def test_long_context_is_incremental():
    """A few thousand tokens committed one at a time: per-step cost must not grow with the
    context (a scan per step would be ~n^2/2 = 8M token compares here)."""
    import time

    rng = random.Random(0)
    p = NgramProposer(num_speculative_tokens=8, prompt_lookup_min=2, prompt_lookup_max=5)
    history = [rng.randrange(100) for _ in range(1000)]
    p.propose([full(3, history, 8)])
    t0 = time.perf_counter()
    hits = 0
    for _ in range(3000):
        tok = rng.randrange(100) if rng.random() < 0.5 else history[len(history) // 2]
        history.append(tok)
        (prop,) = p.propose([ProposeRequest(3, [tok], len(history), 8)])
        hits += bool(prop.token_ids)
    elapsed = time.perf_counter() - t0
    assert hits > 0
    assert p.propose([ProposeRequest(3, [], len(history), 8)])[0].token_ids == brute_force(history, 2, 5, 8)
    assert elapsed < 10.0, f"3000 steps took {elapsed:.1f}s"
