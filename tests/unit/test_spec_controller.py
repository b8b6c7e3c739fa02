"""Speculation controller: k from the measured cost model and acceptance history."""
from __future__ import annotations

from specd.engine.spec_controller import EXPLORE_SHARE, MIN_SAMPLES, LinearCost, SpecController, expected_tokens
from specd.engine.spec_stats import SpecStats


def _trained(verify, alpha: float, max_k: int = 4, seqs=range(32)) -> SpecController:
    c = SpecController(max_k)
    for t in range(1, 200, 7):
        c.observe_verify(t, verify(t))
    c.observe_draft(4, 1, 4 * 0.0001)
    c.observe_draft(4, 32, 4 * 0.0032)
    for sid in seqs:
        for _ in range(50):  # a per-token acceptance of alpha, as geometric outcomes
            accepted = 0
            while accepted < 4 and (hash((sid, _, accepted)) % 1000) / 1000 < alpha:
                accepted += 1
            c.observe_accept(sid, 4, accepted)
    c.explore_credit = 0.0  # no exploration unless a test grants the budget
    return c


def test_linear_cost_recovers_a_line():
    cost = LinearCost()
    for t in range(1, 50):
        cost.observe(t, 0.002 + 0.0005 * t)
    assert abs(cost(100) - (0.002 + 0.05)) < 1e-6


def test_expected_tokens():
    assert expected_tokens(0.5, 0) == 1.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-12
    assert expected_tokens(1.0, 3) == 4.0


def test_flat_verify_cost_and_high_acceptance_speculates_fully():
    c = _trained(lambda t: 0.010 + 0.00001 * t, alpha=0.9, seqs=[0])
    assert c.choose([(0, 4, None)], base_tokens=1) == [4]


def test_compute_bound_large_batch_switches_off():
    c = _trained(lambda t: 0.0005 + 0.001 * t, alpha=0.6)
    ks = c.choose([(i, 4, None) for i in range(32)], base_tokens=32)
    assert ks == [0] * 32


def test_low_acceptance_switches_off_even_at_batch_one():
    c = _trained(lambda t: 0.004 + 0.001 * t, alpha=0.02, seqs=[0])
    assert c.choose([(0, 4, None)], base_tokens=1) == [0]


def test_override_and_cap_are_respected():
    c = _trained(lambda t: 0.010 + 0.00001 * t, alpha=0.9, seqs=[0, 1, 2])
    assert c.choose([(0, 4, 0), (1, 2, None), (2, 4, 3)], base_tokens=3) == [0, 2, 3]


def test_untrained_uses_full_k():
    c = SpecController(5)
    assert c.verify_cost.n < MIN_SAMPLES
    assert c.choose([(0, 5, None), (1, 2, None)], base_tokens=2) == [5, 2]


def test_exploration_spends_a_bounded_share_of_verify_time():
    verify = lambda t: 0.0005 + 0.001 * t  # noqa: E731  compute-bound: speculation stays off
    c = _trained(verify, alpha=0.1)
    c.explore_credit = 0.0
    seqs = [(i, 4, None) for i in range(32)]
    explored, verify_s, spent = [], 0.0, 0.0
    for _ in range(400):
        ks = c.choose(seqs, base_tokens=32)
        assert sorted(ks) in ([0] * 32, [0] * 31 + [4])  # at most one sequence, at full k
        tokens = 32 + sum(ks)
        c.observe_verify(tokens, verify(tokens))
        verify_s += verify(tokens)
        if any(ks):
            explored.append(ks.index(4))
            spent += c.draft_cost(1) * 4 + verify(tokens) - verify(32)
    assert len(explored) >= 10 and set(explored) == {explored[0]}  # sticky: its drafter state stays warm
    assert spent <= EXPLORE_SHARE * verify_s + spent / len(explored)  # within the budget (+ one)
    # When the exploring sequence leaves the batch another one takes over.
    c.explore_credit = 1.0
    others = [s for s in seqs if s[0] != explored[0]]
    assert c.choose(others, base_tokens=31)[0] == 4 and c.explore_seq == others[0][0]
    # A sequence whose request fixed k = 0 is never explored.
    c.explore_credit = 1.0
    assert c.choose([(0, 4, 0)], base_tokens=1) == [0]


def test_spec_stats_counts_and_ratios():
    s = SpecStats()
    s.observe_draft(0, 0)  # no drafts: nothing counted
    s.observe_draft(4, 2)
    s.observe_draft(3, 3, cached=True)  # drafted ahead by a pipelined drafter
    assert s.to_dict() == {"drafts": 2, "draft_tokens": 7, "accepted_tokens": 5, "accepted_per_pos": [2, 2, 1, 0],
                           "cached_drafts": 1}
    assert abs(s.acceptance_rate - 5 / 7) < 1e-12 and s.mean_acceptance_length == 3.5


def test_drafts_taken_from_a_pipelined_drafters_cache_cost_only_the_wait():
    """Drafting priced at (1 - h)·D·k + h·W: with drafts slow against verify, k = 0 wins while
    every proposal is drafted on request, and speculation pays once most come from the cache."""
    c = _trained(lambda t: 0.010 + 0.00001 * t, alpha=0.5, seqs=[0])
    for _ in range(20):
        c.observe_draft(4, 1, 4 * 0.004)  # synchronous: 4 ms per draft step, 16 ms per call
    assert c.choose([(0, 4, None)], base_tokens=1) == [0]
    sync = c.draft_seconds(1, 4)
    for _ in range(40):
        c.observe_draft(4, 1, 0.0005, cached=1.0)  # drafted ahead: a 0.5 ms wait
    assert c.hit_rate > 0.95 and abs(c.hit_wait - 0.0005) < 1e-9
    assert c.draft_seconds(1, 4) < 0.1 * sync
    assert c.choose([(0, 4, None)], base_tokens=1)[0] > 0
