"""Speculation controller: k from the measured cost model and acceptance history."""
from __future__ import annotations

import random

from specd.engine.spec.acceptance import expected_tokens
from specd.engine.spec.controller import MIN_SAMPLES, SpecController
from specd.engine.spec.costs import DraftCost, LinearCost, RealizedCalibration, VerifyCost
from specd.engine.spec.exploration import EXPLORE_SHARE
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
    _decoded(c, seqs)  # the tokens of that history, for the ledger
    c.grant_exploration(0.0)  # no exploration unless a test grants the budget
    return c


def _decoded(c: SpecController, seq_ids, tokens: int = 200) -> None:
    """These sequences have decoded `tokens` tokens plain: their ledgers (spec/ledger.py) let a step
    cost them up to its slack of that, so a test of what the plan prices is not one of the ledger."""
    for sid in seq_ids:
        for _ in range(tokens):
            c.ledger.charge(sid, 0.0)


def test_linear_cost_recovers_a_line():
    cost = LinearCost()
    for t in range(1, 50):
        cost.observe(t, 0.002 + 0.0005 * t)
    assert abs(cost(100) - (0.002 + 0.05)) < 1e-6


def test_draft_cost_keeps_batch_sizes_apart():
    cost = DraftCost()
    for _ in range(5):
        cost.observe(1, 0.004)
    cost.observe(1, 0.150)  # a first read of a long history: one call, not the price
    for _ in range(40):
        cost.observe(32, 0.040)  # a long stretch under 32 streams...
    assert cost(1) == 0.004  # ...leaves batch 1's own price alone (a single line went flat at 0.040)
    assert cost(30) == 0.040
    assert abs(cost(8) - cost.line(8)) < 1e-12  # a size not seen yet: the line through all calls


def test_verify_cost_keeps_small_token_counts_apart_and_prices_new_ones_at_least():
    cost = VerifyCost()
    for _ in range(3):
        cost.observe(1, 0.010)
        cost.observe(5, 0.018)
    assert cost(1) == 0.010 and cost(5) == 0.018
    assert cost(3) == 0.010  # not measured: the dearest smaller count, so it gets tried
    cost.observe(3, 0.0105)
    assert cost(3) == 0.0105 and cost(4) == 0.0105
    cost.observe(3, 0.5)  # one slow step among five does not move the median
    cost.observe(3, 0.0104)
    assert cost(3) == 0.0105
    assert abs(cost(100) - cost.line(100)) < 1e-12  # beyond the table: the line
    # a drafter that drafts 4 tokens for 7 in 8 proposals: between 4 and 5 tokens, not rounded to 4
    assert abs(cost(1 + 0.875 * 4) - (0.0105 + 0.5 * (0.018 - 0.0105))) < 1e-12


def test_a_verify_tile_that_fills_for_free_is_found():
    """CPU matmul tiles (4 rows on AVX2): 1-4 tokens cost one tile, 5-8 two. With a cheap drafter
    and high acceptance, k = 3 beats k = 4 (E 3.44 / 10 ms vs 4.10 / 18 ms), though a line through
    1 and 5 tokens would price k = 3 at 16 ms and pick k = 4."""
    verify = lambda t: 0.010 * ((t + 3) // 4)  # noqa: E731
    c = SpecController(4)
    for _ in range(MIN_SAMPLES):  # warm-up at full k, then plain decoding once
        c.observe_verify(5, verify(5))
    c.observe_verify(1, verify(1))
    c.observe_draft(4, 1, 4 * 0.0001)
    for i in range(200):
        c.observe_accept(0, 4, 4 if i % 10 else 2)
    chosen = []
    for _ in range(12):
        k = c.choose([(0, 4, None)], base_tokens=1)[0]
        c.observe_verify(1 + k, verify(1 + k))
        chosen.append(k)
    assert chosen[-6:] == [3] * 6, chosen
    line = LinearCost()
    for t in (1, 5):
        line.observe(t, verify(t))
    assert expected_tokens(0.9, 3) / line(4) < expected_tokens(0.9, 4) / line(5)


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


def test_sampled_requests_do_not_lower_the_prior_of_greedy_ones():
    """A batch of sampled requests that reject most drafts, then new requests: a greedy one starts
    from what greedy sequences accepted, a sampled one from what sampled ones did (one prior for
    both turned speculation off for the greedy code edits after a sampled batch)."""
    c = _trained(lambda t: 0.010 + 0.0005 * t, alpha=0.9, seqs=[0])  # greedy history: accepts
    for sid in range(100, 132):
        c.note_sampling(sid, True)
        for _ in range(50):
            c.observe_accept(sid, 4, 0)  # sampled: rejects the first draft
        c.release(sid)
    c.note_sampling(200, False)
    c.note_sampling(201, True)
    assert c.choose([(200, 4, None)], base_tokens=1)[0] > 0
    assert c.choose([(201, 4, None)], base_tokens=1) == [0]


def test_a_sampled_sequence_starts_from_what_greedy_ones_accepted():
    """No sampled history yet, but greedy sequences accepted few drafts: a new sampled sequence
    starts from that, not from the optimistic PRIOR_ALPHA, so it does not speculate where greedy
    ones learned it does not pay; once sampled sequences accept, their own history counts."""
    verify = lambda t: 0.010 + 0.003 * t  # noqa: E731  every token costs: a draft must be likely to pay
    c = _trained(verify, alpha=0.2, seqs=[0])  # greedy history: mostly rejects
    for t in range(1, 17):
        c.observe_verify(t, verify(t))
    c.grant_exploration(0.0)  # (those observations earned exploration credit: spend none)
    c.note_sampling(300, True)
    assert c.estimates(300, None)[0] < 0.35
    assert c.choose([(300, 4, None)], base_tokens=1) == [0]
    for sid in range(100, 132):  # sampled sequences that accept
        c.note_sampling(sid, True)
        for _ in range(50):
            c.observe_accept(sid, 4, 4)
        c.release(sid)
    c.note_sampling(301, True)
    assert c.estimates(301, None)[0] > 0.9
    assert c.choose([(301, 4, None)], base_tokens=1)[0] > 0


def test_untrained_uses_full_k():
    c = SpecController(5)
    assert c.verify_cost.n < MIN_SAMPLES
    assert c.choose([(0, 5, None), (1, 2, None)], base_tokens=2) == [5, 2]


def test_exploration_spends_a_bounded_share_of_verify_time():
    verify = lambda t: 0.010 + 0.001 * t  # noqa: E731  acceptance 0.1: speculation stays off
    c = _trained(verify, alpha=0.1)
    c.grant_exploration(0.0)
    seqs = [(i, 4, None) for i in range(32)]
    explored, verify_s, spent = [], 0.0, 0.0
    for _ in range(400):
        ks = c.choose(seqs, base_tokens=32)
        assert sorted(ks)[:-1] == [0] * 31  # at most one sequence
        tokens = 32 + sum(ks)
        c.observe_verify(tokens, verify(tokens))
        verify_s += verify(tokens)
        if any(ks):
            explored.append(next(i for i, k in enumerate(ks) if k))
            spent += c.drafter().cost(1) * max(ks) + verify(tokens) - verify(32)
    assert len(explored) >= 10 and set(explored) == {explored[0]}  # sticky: its drafter state stays warm
    assert spent <= EXPLORE_SHARE * verify_s + spent / len(explored)  # within the budget (+ one)
    # When the exploring sequence leaves the batch another one takes over.
    c.grant_exploration(1.0)
    others = [s for s in seqs if s[0] != explored[0]]
    assert c.choose(others, base_tokens=31)[0] > 0 and c.exploration.seq == others[0][0]
    # A sequence whose request fixed k = 0 is never explored.
    c.grant_exploration(1.0)
    assert c.choose([(0, 4, 0)], base_tokens=1) == [0]


def test_exploration_is_charged_what_its_cycles_really_took():
    """The model prices a try at the drafter's usual call and a few verify rows; a draft model that
    must first read the sequence's whole history (on the cores the verifier computes on) makes
    the cycle 30 ms longer. Charged what the cycles took, exploring stays within its share of
    the time (charged what was predicted, it spent several times that)."""
    verify = lambda t: 0.010 + 0.001 * t  # noqa: E731  acceptance 0.1: speculation stays off
    c = _trained(verify, alpha=0.1)
    seqs = [(i, 4, None) for i in range(32)]
    now, extra, verify_s, tries = 0.0, 0.0, 0.0, 0
    for _ in range(2000):
        c.close_cycle(now)
        ks = c.choose(seqs, base_tokens=32)
        tokens = 32 + sum(ks)
        c.observe_verify(tokens, verify(tokens))
        verify_s += verify(tokens)
        seconds = verify(tokens) + (0.030 if any(ks) else 0.0)
        c.open_cycle(32, now, seconds)
        now += seconds
        extra += seconds - verify(32)
        tries += any(ks)
    assert tries >= 5  # it still explores
    assert extra <= EXPLORE_SHARE * verify_s + 2 * (0.030 + verify(36) - verify(32))  # the share, and a try or two


def test_no_exploration_where_not_even_perfect_drafts_would_pay():
    """Each verify row costs what a sequence's step does (a CPU at batch 32): k drafts, all
    accepted, give k tokens for more than k rows' time, so there is nothing to learn and no try
    is made, whatever the budget. Where rows are cheap (a weight-streaming step) it explores."""
    for verify, explores in ((lambda t: 0.001 * t, False), (lambda t: 0.030 + 0.0002 * t, True)):
        c = _trained(verify, alpha=0.1)
        c.grant_exploration(1.0)
        ks = c.choose([(i, 4, None) for i in range(32)], base_tokens=32)
        assert any(ks) == explores, (explores, ks)


def test_spec_stats_counts_and_ratios():
    s = SpecStats()
    s.observe_draft(0, 0)  # no drafts: nothing counted
    s.observe_draft(4, 2, drafter="model")
    s.observe_draft(3, 3, cached=True, drafter="suffix")  # drafted ahead by a pipelined drafter
    s.observe_draft(0, 0, drafter="suffix")  # an empty proposal is no draft
    assert s.to_dict() == {"drafts": 2, "draft_tokens": 7, "accepted_tokens": 5, "accepted_per_pos": [2, 2, 1, 0],
                           "cached_drafts": 1, "drafts_by_drafter": {"model": 1, "suffix": 1}}
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
    assert c.drafter().hit_rate > 0.95 and abs(c.drafter().hit_wait - 0.0005) < 1e-9
    assert c.draft_seconds(1, 4) < 0.1 * sync
    assert c.choose([(0, 4, None)], base_tokens=1)[0] > 0


def test_a_drafter_that_drafts_in_one_forward_is_priced_per_call_not_per_token():
    """A parallel drafter's call costs the same for any k: priced as one step, it gets the chain
    that fills the verify tile, where a drafter with the same call time at k = 4 but one forward
    per token is given a shorter one (each draft costs it a forward)."""
    def tile(t):  # 1-4 tokens cost one matmul tile, 5-8 two
        return 0.010 if t <= 4 else 0.018

    seq = _trained(tile, alpha=0.5, seqs=[0])
    par = _trained(tile, alpha=0.5, seqs=[0])
    for c in (seq, par):
        for t in range(1, 9):
            for _ in range(5):
                c.observe_verify(t, tile(t))
    for _ in range(20):
        seq.observe_draft(4, 1, 0.004)  # 4 ms for 4 drafts: 1 ms per forward
        par.observe_draft(1, 1, 0.004, one_forward=True)  # 4 ms for any k
    assert abs(seq.draft_seconds(1, 4) - 0.004) < 1e-9 and abs(seq.draft_seconds(1, 1) - 0.001) < 1e-9
    assert abs(par.draft_seconds(1, 1) - 0.004) < 1e-9 and abs(par.draft_seconds(1, 4) - 0.004) < 1e-9
    assert par.choose([(0, 4, None)], base_tokens=1) == [3]  # 4 rows verify for the price of 1
    assert seq.choose([(0, 4, None)], base_tokens=1)[0] < 3


def _two_drafters(verify, seqs: dict, model_step_s: float = 0.003, suffix_call_s: float = 0.0003) -> SpecController:
    """A controller that has seen a draft model (model_step_s per draft step) and a suffix index
    (one cheap round trip per call) draft for `seqs`: {seq_id: {drafter: (alpha, share with drafts)}}."""
    c = SpecController(4)
    for t in range(1, 200, 7):
        c.observe_verify(t, verify(t))
    for _ in range(10):
        c.observe_draft(4, 1, 4 * model_step_s, name="model")
        c.observe_draft(4, 1, suffix_call_s, name="suffix")
    for sid, by_drafter in seqs.items():
        for name, (alpha, made) in by_drafter.items():
            rng = random.Random(f"{sid} {name}")
            for _ in range(60):
                drafted = rng.random() < made
                c.observe_proposal(sid, name, drafted)
                if drafted:
                    accepted = 0
                    while accepted < 4 and rng.random() < alpha:
                        accepted += 1
                    c.observe_accept(sid, 4, accepted, name)
    _decoded(c, seqs)  # the tokens of that history, for the ledger
    c.current.clear()
    c.grant_exploration(0.0)
    return c


def test_a_cheap_drafter_that_matches_is_chosen_over_an_expensive_one():
    c = _two_drafters(lambda t: 0.010 + 0.0002 * t, {0: {"model": (0.4, 1.0), "suffix": (0.9, 0.8)}})
    ((k, name),) = c.plan([(0, 4, None)], 1, ["model", "suffix"])
    assert name == "suffix" and k == 4


def test_each_sequence_gets_its_own_drafter():
    """A code edit (the suffix index matches) beside a chat answer (only the model predicts it)."""
    c = _two_drafters(lambda t: 0.010 + 0.0002 * t,
                      {0: {"model": (0.3, 1.0), "suffix": (0.95, 0.9)}, 1: {"model": (0.8, 1.0), "suffix": (0.2, 0.1)}},
                      model_step_s=0.0005)
    plan = c.plan([(0, 4, None), (1, 4, None)], 2, ["model", "suffix"])
    assert [name for _, name in plan] == ["suffix", "model"] and all(k > 0 for k, _ in plan)


def test_speculation_stays_off_when_no_drafter_pays():
    """Chat on a slow drafter, and a suffix index that rarely finds a match: plain decoding."""
    c = _two_drafters(lambda t: 0.010 + 0.0005 * t, {0: {"model": (0.3, 1.0), "suffix": (0.3, 0.05)}},
                      model_step_s=0.004)
    assert c.plan([(0, 4, None)], 1, ["model", "suffix"]) == [(0, "model")]


def test_a_sequence_keeps_its_drafter_unless_another_is_clearly_better():
    seqs = {0: {"model": (0.80, 1.0), "suffix": (0.82, 1.0)}}
    c = _two_drafters(lambda t: 0.010 + 0.0002 * t, seqs, model_step_s=0.0003, suffix_call_s=0.0012)
    c.current[0] = "model"  # a switch re-reads the whole history: 2% more is not worth it
    assert c.plan([(0, 4, None)], 1, ["model", "suffix"])[0][1] == "model"
    seqs = {0: {"model": (0.30, 1.0), "suffix": (0.9, 1.0)}}
    c = _two_drafters(lambda t: 0.010 + 0.0002 * t, seqs, model_step_s=0.0003, suffix_call_s=0.0012)
    c.current[0] = "model"
    assert c.plan([(0, 4, None)], 1, ["model", "suffix"])[0][1] == "suffix"


def test_a_request_that_named_its_drafter_keeps_it():
    c = _two_drafters(lambda t: 0.010 + 0.0002 * t, {0: {"model": (0.4, 1.0), "suffix": (0.9, 0.8)}})
    ((k, name),) = c.plan([(0, 4, None)], 1, ["model", "suffix"], pinned={0: "model"})
    assert name == "model"


def test_exploration_drafts_the_k_the_model_would_pick_not_max_k():
    """A 4-row verify tile (AVX2): exploring k = 3 costs one step's rows, k = 8 two tiles."""
    verify = lambda t: 0.010 * ((t + 3) // 4)  # noqa: E731
    c = SpecController(8)
    for t in range(1, 17):
        for _ in range(MIN_SAMPLES):
            c.observe_verify(t, verify(t))
    c.observe_draft(8, 1, 8 * 0.0001)
    for _ in range(50):
        c.observe_accept(0, 3, 0)  # nothing accepted: speculation stays off, but is explored
    c.grant_exploration(1.0)
    # not before its plain steps have earned the slack the try costs it (spec/ledger.py)
    assert c.choose([(0, 8, None)], base_tokens=1) == [0]
    _decoded(c, [0])
    assert c.choose([(0, 8, None)], base_tokens=1) == [3]


def test_exploration_weighs_tries_by_what_they_cost():
    """A drafter whose try costs several times another's is explored about once for that many
    tries of the cheap one, not first and every other time (waiting for its budget starved the
    cheap drafter)."""
    c = _two_drafters(lambda t: 0.0005 + 0.001 * t, {0: {"model": (0.1, 1.0), "suffix": (0.1, 1.0)}},
                      model_step_s=0.001)  # a try: ~1 ms a draft step against ~0.1 ms
    picked = []
    _decoded(c, [5])
    for _ in range(40):  # a sequence new to both drafters, 5
        c.grant_exploration(1.0)
        plan = c.plan([(5, 4, None)], 1, ["model", "suffix"])
        picked += [name for k, name in plan if k]
        c.observe_proposal(5, picked[-1], True)
    assert picked[0] == "suffix" and 1 <= picked.count("model") <= len(picked) // 3, picked


def test_a_dear_drafter_does_not_starve_the_others_exploration():
    """Each drafter earns its share of the budget: while a draft model's try (priced ~100 ms) is
    saved up for, the suffix index (a few ms a try) goes on being explored."""
    verify = lambda t: 0.0005 + 0.001 * t  # noqa: E731
    c = _two_drafters(verify, {0: {"model": (0.1, 1.0), "suffix": (0.1, 1.0)}}, model_step_s=0.025)
    c.grant_exploration(0.0)
    picked = []
    for _ in range(400):
        plan = c.plan([(5, 4, None)], 1, ["model", "suffix"])
        picked += [name for k, name in plan if k]
        c.observe_verify(1 + sum(k for k, _ in plan), 0.010)
    assert len(picked) >= 5 and set(picked) == {"suffix"}


def test_exploration_tries_the_drafter_a_sequence_has_tried_least():
    c = _two_drafters(lambda t: 0.0005 + 0.001 * t, {i: {"model": (0.1, 1.0)} for i in range(8)})
    c.grant_exploration(1.0)
    plan = c.plan([(i, 4, None) for i in range(8)], 8, ["model", "suffix"])
    assert [p[1] for p in plan if p[0]] == ["suffix"]


def _run(c: SpecController, seqs, now: float, steps: int, cycle) -> tuple[float, int]:
    """Drive the controller as the engine does: cycle(ks) -> seconds the step's cycle took."""
    spec_steps = 0
    for _ in range(steps):
        c.close_cycle(now)  # as the engine: the last cycle ends where this step begins
        ks = c.choose(seqs, base_tokens=len(seqs))
        spec_steps += any(ks)
        seconds = cycle(ks)
        c.open_cycle(len(seqs), now, seconds)
        now += seconds
    return now, spec_steps


def test_realized_calibration_turns_speculation_off_where_it_ran_slower():
    """The cost model says speculate (10 ms a step, acceptance 0.9: ~3,200 tok/s against plain's
    ~800); measured cycles say a speculative one takes 60 ms (what the model does not see: a
    slow drafter's round trip, cores it takes), about 550 tok/s, and a plain one 8 ms (1,000 tok/s):
    speculation runs only on its probes, spaced so that they cost at most PROBE_SHARE of the
    time (every 64 cycles they cost 16%), and comes back once it pays."""
    c = _trained(lambda t: 0.010 + 0.00001 * t, alpha=0.9, seqs=range(8))
    seqs = [(i, 4, None) for i in range(8)]
    g = RealizedCalibration
    steps = 2000
    rng = random.Random(1)
    made = {"tokens": 0}

    def cycle(spec_s: float):
        def run(ks):  # every sequence's drafts accepted at 0.9 a token, reported as the engine does
            for sid, k in enumerate(ks):
                accepted = 0
                while accepted < k and rng.random() < 0.9:
                    accepted += 1
                c.observe_accept(sid, k, accepted)
                made["tokens"] += 1 + accepted
            return spec_s if any(ks) else 0.008
        return run
    now, spec_steps = _run(c, seqs, 0.0, steps, cycle(0.060))
    assert spec_steps >= g.PROBE_CYCLES  # it did measure speculation
    assert made["tokens"] / now >= (1 - 2 * g.PROBE_SHARE) * 1000  # the budget, and the first cycles' learning
    # The drafter is fast again (15 ms a step, ~2,200 tok/s): after the next probe it stays on, but for plain's probes.
    now, spec_steps = _run(c, seqs, now, g.PROBE_MAX + 300, cycle(0.015))
    assert spec_steps >= 300 - g.PROBE_CYCLES * (1 + 300 // g.PROBE_AFTER["spec"])


def test_a_short_run_of_hard_text_does_not_turn_speculation_off():
    """Acceptance that drops for a stretch (the end of a quoted passage) lowers what the model
    expects as much as what the cycles give: speculation goes on where it pays, instead of being
    judged by its worst cycles against plain decoding's average (the guard that compared raw
    rates ran 2.38x plain here)."""
    verify = lambda t: 0.020 + 0.0005 * t  # noqa: E731
    c = _trained(verify, alpha=0.8, seqs=[0])
    rng = random.Random(0)
    state = {"cycle": 0, "tokens": 0}

    def cycle(ks):
        state["cycle"] += 1
        alpha = 0.2 if state["cycle"] % 40 < 10 else 0.9  # 10 hard cycles in every 40
        accepted = 0
        while accepted < ks[0] and rng.random() < alpha:
            accepted += 1
        if ks[0]:
            c.observe_accept(0, ks[0], accepted)
        state["tokens"] += 1 + accepted
        return verify(1 + ks[0])

    now, spec_steps = _run(c, [(0, 4, None)], 0.0, 600, cycle)
    assert spec_steps >= 0.9 * 600
    assert state["tokens"] / now >= 2.7 / verify(1)


def test_calibration_ignores_idle_gaps_and_batch_sizes_apart():
    g = RealizedCalibration()
    assert g.bucket(1) == 1 and g.bucket(3) == 4 and g.bucket(8) == 8 and g.bucket(9) == 16
    c = SpecController(4)
    c.step_mode, c._predicted = "plain", 0.010
    c.open_cycle(1, 0.0, 0.010)
    c.close_cycle(5.0)  # the engine waited for a request: no cycle
    assert c.calibration.get(1, "plain").n == 0
    c.open_cycle(1, 5.0, 0.010)
    c.close_cycle(5.012)
    assert c.calibration.get(1, "plain").n == 1 and c.calibration.get(8, "plain").n == 0
    assert 0.010 / 0.012 < c.calibration.scale(1, "plain") < 1.0  # slower than predicted, drawn to the prior


def _copying_drafter(verify, drafts_of: int, max_k: int = 16) -> SpecController:
    """A suffix-like drafter at batch 1: half its drafts miss at the first token; the other half
    copy a passage the target repeats, every token of it accepted; it drafts drafts_of tokens
    whatever k it is asked for. Measured at k = 4 only, as a controller capped there would."""
    c = SpecController(max_k)
    for t in range(1, 40):
        c.observe_verify(t, verify(t))
    c.observe_draft(1, 1, 0.0002, name="suffix")
    for i in range(400):
        drafted = min(4, drafts_of)
        c.observe_proposal(7, "suffix", True, drafted, 4)
        c.observe_accept(7, drafted, drafted if i % 2 else 0, "suffix")
    c.grant_exploration(0.0)
    return c


def test_acceptance_by_position_prices_a_long_copy():
    """Geometric α reads the copies above as 0.81 per token, and its best k is then 8 (16 would add
    0.6 tokens for 8 more rows); by position, a draft that got its first token right goes on, all of
    it accepted: k up to the cap pays where verify rows are cheap, and the sequence drafts its longest."""
    verify = lambda t: 0.010 + 0.0004 * t  # noqa: E731 — a CPU at batch 1: a row costs 4% of a step
    c = _copying_drafter(verify, drafts_of=16)
    ((k, name),) = c.plan([(7, 16, None)], 1, ["suffix"])
    assert name == "suffix" and k == 16
    accepted, rows = c.prices.curve(7, "suffix", c.estimates(7, "suffix")[0], 16)
    assert abs(accepted - 0.5 * 16) < 0.8 and rows > 15  # half the drafts accepted whole, all 16 rows verified


def test_a_drafter_that_drafts_few_tokens_is_priced_by_the_rows_it_drafts():
    """Asked for 4, it drafts 2, each accepted: its step is a verify of 3 tokens, not 5 (where each
    row costs half a step, as on a GPU-like step, pricing 5 rows made it look 1.5x dearer)."""
    verify = lambda t: 0.010 + 0.005 * (t - 1)  # noqa: E731
    c = _copying_drafter(verify, drafts_of=2, max_k=4)
    for i in range(60):
        c.observe_proposal(7, "suffix", True, 2, 4)
        c.observe_accept(7, 2, 2, "suffix")
    ((k, _),) = c.plan([(7, 4, None)], 1, ["suffix"])
    assert k >= 2
    assert abs(c._predicted - (verify(3) + 0.0002)) < 0.001  # 3 tokens' forward and the draft call


def _offering_drafter(verify, outcomes: dict, rounds: int = 200, max_t: int = 30) -> SpecController:
    """A controller that has verified drafts an in-process index offered before each plan:
    outcomes {length offered, or (source, length): share of each draft accepted whole (else none
    of it)}."""
    c = SpecController(8)
    for t in range(1, max_t):
        for _ in range(3):
            c.observe_verify(t, verify(t))
    rng = random.Random(5)
    for _ in range(rounds):
        for key, p in outcomes.items():
            source, length = key if isinstance(key, tuple) else ("", key)
            c.observe_proposal(9, "suffix", True)
            c.observe_accept(9, length, length if rng.random() < p else 0, "suffix", offered=length, source=source)
    c.grant_exploration(0.0)
    return c


def test_offered_drafts_are_read_by_their_length():
    """A suffix index's one-token drafts (a one-token match) are rarely right, its long ones mostly:
    with the drafts known before the plan, the long one is verified whole and the short one not at all,
    where one α over both would price them alike."""
    verify = lambda t: 0.010 + 0.001 * (t - 1)  # noqa: E731 — a CPU at batch 1: a row costs 10% of a step
    c = _offering_drafter(verify, {1: 0.1, 8: 0.8})
    _decoded(c, [1, 2])
    plan = c.plan([(1, 8, None), (2, 8, None)], 2, ["suffix"], offered={1: {"suffix": 8}, 2: {"suffix": 1}})
    assert plan[0] == (8, "suffix") and plan[1][0] == 0
    accepted, rows = c.prices.offered_curve(1, "suffix", 8, 8)
    assert rows == 8 and 0.8 * 8 - 1.0 < accepted < 0.8 * 8 + 1.0
    short, _ = c.prices.offered_curve(2, "suffix", 8, 1)
    assert short < 0.3  # 0.1 measured, drawn a little towards the drafter over all lengths


def test_an_offer_is_priced_by_its_source_and_length_not_the_sequence_s_last_drafts():
    """A sequence whose last drafts were all rejected (prose after a copied passage) is offered a
    one-token draft of a kind accepted a quarter of the time, enough to pay for its row: taken. Its
    own α had priced it at a fraction of that, and on chat at batch 1 such offers, dropped, made what
    the ones taken did."""
    verify = lambda t: 0.010 + 0.001 * (t - 1)  # noqa: E731 — a row costs 10% of a step
    c = _offering_drafter(verify, {1: 0.25}, rounds=2000)
    _decoded(c, [1])
    for _ in range(20):
        c.observe_proposal(1, "suffix", True)
        c.observe_accept(1, 4, 0, "suffix", offered=4)
    assert c.estimates(1, "suffix")[0] < 0.1
    accepted, rows = c.prices.offered_curve(1, "suffix", 8, 1)
    assert rows == 1 and 0.2 < accepted < 0.3
    assert c.plan([(1, 8, None)], 1, ["suffix"], offered={1: {"suffix": 1}})[0] == (1, "suffix")


def test_one_stream_is_not_scaled_by_its_last_cycles_accepted_drafts():
    """At batch 1 a one-token offer of a kind accepted a fifth of the time pays for its row. A run of
    speculative cycles that made half their prediction (one stream, greedy or sampled: a few unlucky
    drafts) does not drop it; in batches the ratio still scales what a plan expects."""
    verify = lambda t: 0.010 + 0.001 * (t - 1)  # noqa: E731 — a row costs 10% of a step
    c = _offering_drafter(verify, {1: 0.2}, rounds=2000)
    _decoded(c, [1, 2])
    c.note_sampling(2, True)
    for _ in range(40):
        for n in (1, 8):
            c.calibration.observe(n, "spec", 0.011, 0.011, 0.5, 1.0)
            c.calibration.observe(n, "spec", 0.011, 0.011, 0.5, 1.0, sampled=True)
            c.calibration.observe(n, "plain", 0.010, 0.010)  # plain measured too: the plan is no probe
    assert c.calibration.extra_scale(1) == 1.0 == c.calibration.extra_scale(1, sampled=True)
    assert 0.45 < c.calibration.extra_scale(8) < 0.55 and 0.45 < c.calibration.extra_scale(8, sampled=True) < 0.55
    for sid in (1, 2):  # greedy, sampled
        assert c.plan([(sid, 8, None)], 1, ["suffix"], offered={sid: {"suffix": 1}})[0] == (1, "suffix"), sid


def test_an_offered_empty_draft_is_plain_decoding_and_costs_nothing():
    """No match, no draft: the sequence decodes plain (no k asked of anyone), and where another
    sequence drafts, the step is priced by that one's rows only, with no draft call to wait for."""
    verify = lambda t: 0.010 + 0.001 * (t - 1)  # noqa: E731
    c = _offering_drafter(verify, {4: 0.9})
    c.observe_draft(4, 1, 0.005, name="suffix")  # a dear call the drafts made before the plan do not pay
    _decoded(c, [1, 2])
    plan = c.plan([(1, 8, None), (2, 8, None)], 2, ["suffix"], offered={1: {"suffix": 0}, 2: {"suffix": 4}})
    assert plan[0][0] == 0 and plan[1] == (4, "suffix")
    assert c.step_mode == "spec" and abs(c._predicted - verify(2 + 4)) < 1e-9
    assert c.plan([(1, 8, None)], 1, ["suffix"], offered={1: {"suffix": 0}})[0][0] == 0
    assert c.step_mode == "plain"


def test_an_offered_drafter_beside_a_service_is_chosen_per_sequence():
    """The draft model drafts for the sequence the index has nothing for; the index's long draft
    goes to the other one, free of the margin a drafter switch pays (it holds the history already)."""
    verify = lambda t: 0.010 + 0.0005 * (t - 1)  # noqa: E731
    c = _offering_drafter(verify, {6: 0.9})
    for _ in range(30):
        c.observe_draft(4, 2, 4 * 0.0003, name="model")
        for sid in (1, 2):
            c.observe_proposal(sid, "model", True)
            c.observe_accept(sid, 4, 2, "model")
    plan = c.plan([(1, 8, None), (2, 8, None)], 2, ["suffix", "model"], offered={1: {"suffix": 6}, 2: {"suffix": 0}})
    assert plan[0][1] == "suffix" and plan[0][0] >= 6 and plan[1][1] == "model" and plan[1][0] > 0


def test_the_index_is_asked_only_where_one_of_its_drafts_could_pay():
    """Where each verify row costs what a sequence's step does (a CPU at batch 32), no draft the
    index has offered so far pays for its rows, so asking it for every sequence is time lost; at
    batch 1 (a row costs a tenth of a step) the same drafts pay."""
    compute_bound = lambda t: 0.010 + 0.004 * t  # noqa: E731
    c = _offering_drafter(compute_bound, {1: 0.1, 8: 0.5})
    for t in range(30, 45):
        for _ in range(3):
            c.observe_verify(t, compute_bound(t))
    assert not c.offers_may_pay("suffix", 32, 32, 8, {False})[0]
    assert c.offers_may_pay("suffix", 1, 1, 8, {False})[0]
    copies = _offering_drafter(compute_bound, {8: 0.97})  # long copies, nearly always right, pay even there
    for t in range(30, 45):
        for _ in range(3):
            copies.observe_verify(t, compute_bound(t))
    assert copies.offers_may_pay("suffix", 32, 32, 8, {False})[0]
    assert SpecController(8).offers_may_pay("suffix", 32, 32, 8, {False}) == (True, frozenset())  # nothing timed yet: ask


def test_a_source_none_of_whose_drafts_could_pay_is_not_asked():
    """At batch 32 on a CPU the index's own copies pay and its datastore's guesses do not: the index
    is still asked, without the datastore (a lookup costs ~0.1 ms a sequence); at batch 1 both pay."""
    c = _offering_drafter(lambda t: 0.010 + 0.004 * t, {("own", 8): 0.97, ("datastore", 8): 0.3}, 300, max_t=45)
    assert c.offers_may_pay("suffix", 32, 32, 8, {False}) == (True, frozenset({"datastore"}))
    assert c.offers_may_pay("suffix", 1, 1, 8, {False}) == (True, frozenset())


def test_speculative_cycles_that_accept_fewer_drafts_than_predicted_scale_its_tokens_down():
    """The steps the controller picks are those whose acceptance estimates came out high (the
    winner's curse), so its chosen speculative cycles can accept fewer drafts than it predicted
    while each cycle takes the time predicted. Calibration on time alone kept such speculation on;
    the drafts' realized over predicted (extra_scale) turns it off where the tokens it really makes
    do not beat plain decoding's, and leaves it on where they do."""
    verify = lambda t: 0.020 + 0.0030 * t  # noqa: E731  (a compute-bound batch: each row costs)
    seqs = [(i, 4, None) for i in range(8)]

    def picks_spec(accepted_share: float) -> bool:
        c = _trained(verify, alpha=0.8, seqs=range(8))
        c.choose(seqs, base_tokens=8)
        assert c.step_mode == "spec"  # the model alone wants speculation here
        for _ in range(60):  # cycles as predicted in time, the speculative ones accepting a share of the drafts predicted
            c.calibration.observe(8, "spec", c._predicted, c._predicted, accepted_share * 10.0, 10.0)
            c.calibration.observe(8, "plain", verify(8), verify(8))
        return any(c.choose(seqs, base_tokens=8))

    assert picks_spec(1.0)
    assert not picks_spec(0.3)
    g = RealizedCalibration()
    assert g.extra_scale(8) == 1.0  # not measured yet
    for _ in range(80):
        g.observe(8, "spec", 0.03, 0.03, 3.0, 10.0)
    assert 0.29 < g.extra_scale(8) < 0.32 and g.extra_scale(1) == 1.0  # and per batch size
    # Off after that, speculation is probed where the model wants it, and a probe's cycles outweigh
    # the history: four that accept all their drafts bring the scale most of the way back.
    for _ in range(2 * g.PROBE_AFTER["plain"]):
        g.observe(8, "plain", 0.03, 0.03)
        if g.mode(8, "plain") == "spec":
            break
    else:
        raise AssertionError("speculation was never probed")
    for _ in range(g.PROBE_CYCLES):
        g.observe(8, "spec", 0.03, 0.03, 10.0, 10.0)
        g.mode(8, "plain")
    assert g.extra_scale(8) > 0.7  # (0.75 here; 0.30 before the probe)


def test_sampled_steps_are_calibrated_apart_from_greedy_ones():
    """Drafts are accepted less under sampling, and the acceptance model's bias differs by kind: at
    batch 8 on chat, greedy steps had accepted 1.33x what was predicted, and scaled by that, sampled
    steps drafted where they accepted far less (0.94x of plain; 2-core Xeon, 2026-11-29). Each kind's
    realized over predicted scales its own steps: here sampled steps that accept a third of the
    drafts predicted turn speculation off for sampled sequences and leave it on for greedy ones."""
    verify = lambda t: 0.020 + 0.0030 * t  # noqa: E731  (a compute-bound batch: each row costs)
    seqs = [(i, 4, None) for i in range(8)]
    c = _trained(verify, alpha=0.8, seqs=range(8))
    c.choose(seqs, base_tokens=8)
    assert c.step_mode == "spec"  # the model alone wants speculation here
    for _ in range(60):
        for sampled, accepted in ((False, 10.0), (True, 3.0)):
            c.calibration.observe(8, "spec", c._predicted, c._predicted, accepted, 10.0, sampled=sampled)
        c.calibration.observe(8, "plain", verify(8), verify(8))
    assert c.calibration.extra_scale(8) == 1.0 and 0.29 < c.calibration.extra_scale(8, sampled=True) < 0.32
    assert any(c.choose(seqs, base_tokens=8))  # greedy sequences: still speculation
    for sid in range(8):
        c.note_sampling(sid, True)
    assert not any(c.choose(seqs, base_tokens=8))  # the same sequences sampling: plain


def test_an_offered_draft_needs_only_a_small_margin_a_drafter_to_be_asked_the_wide_one():
    """At batch 1 a one-token offer accepted a fifth of the time is predicted ~6% faster than plain
    (~1.06 tokens for 1.1 steps' time, the recent outcomes weighing most): taken, since nothing else is paid for it (OFFER_SWITCH_MARGIN); a
    drafter asked after the plan with the same prediction is not (SWITCH_MARGIN: what the model leaves
    out, e.g. a drafter catching up on a history, costs speculation)."""
    from specd.engine.spec.controller import OFFER_SWITCH_MARGIN, SWITCH_MARGIN

    verify = lambda t: 0.010 + 0.001 * (t - 1)  # noqa: E731 — a row costs 10% of a step
    c = _offering_drafter(verify, {1: 0.2}, rounds=2000)
    accepted, _ = c.prices.offered_curve(1, "suffix", 8, 1)
    assert OFFER_SWITCH_MARGIN < (1 + accepted) / 1.1 < SWITCH_MARGIN
    assert c.plan([(1, 8, None)], 1, ["suffix"], offered={1: {"suffix": 1}})[0] == (1, "suffix")

    m = SpecController(1)
    for t in range(1, 30):
        for _ in range(3):
            m.observe_verify(t, verify(t))
    rng = random.Random(5)
    for _ in range(2000):
        m.observe_draft(1, 1, 1e-6, name="model")
        m.observe_proposal(9, "model", True, 1, 1)
        m.observe_accept(9, 1, int(rng.random() < 0.2), "model")
    m.grant_exploration(0.0)
    accepted, _ = m.prices.curve(1, "model", m.estimates(1, "model")[0], 1)
    assert OFFER_SWITCH_MARGIN < (1 + accepted) / 1.1 < SWITCH_MARGIN
    assert m.plan([(1, 8, None)], 1, ["model"])[0][0] == 0


def test_an_index_keeps_each_sources_acceptance_apart():
    """A suffix index drafts 8 tokens from the request's own history (mostly right) or from a
    datastore (mostly wrong): kept apart by source, the own draft is verified and the datastore's
    of the same length is not; one table for both would price them alike."""
    # rows dear enough that a bad draft does not pay
    c = _offering_drafter(lambda t: 0.010 + 0.004 * (t - 1), {("own", 8): 0.9, ("datastore", 8): 0.05}, 300)
    seqs = [(1, 8, None), (2, 8, None)]
    offered = {1: {"suffix": 8}, 2: {"suffix": 8}}
    _decoded(c, [1, 2], 1000)  # a step of these rows costs the other sequence 2.3 steps: two plans' worth
    plan = c.plan(seqs, 2, ["suffix"], offered=offered, offer_sources={1: {"suffix": "own"}, 2: {"suffix": "datastore"}})
    assert plan[0] == (8, "suffix") and plan[1][0] == 0
    plan = c.plan(seqs, 2, ["suffix"], offered=offered, offer_sources={1: {"suffix": "datastore"}, 2: {"suffix": "own"}})
    assert plan[0][0] == 0 and plan[1] == (8, "suffix")


def test_a_source_is_priced_with_what_speculative_cycles_really_made():
    """The same source and drafts: at batch 8 they are predicted to pay, and asked for; once the
    speculative cycles there have made 0.3 of the accepted tokens predicted, they are not, while
    batch 1 (calibrated on its own) still asks."""
    c = _offering_drafter(lambda t: 0.010 + 0.0015 * t, {("datastore", 8): 0.5}, 300, max_t=45)
    assert c.offers_may_pay("suffix", 8, 8, 8, {False}) == (True, frozenset())
    for _ in range(50):
        c.calibration.observe(8, "spec", 0.03, 0.03, accepted=3.0, predicted_accepted=10.0)
    assert c.offers_may_pay("suffix", 8, 8, 8, {False}) == (False, frozenset({"datastore"}))
    assert c.offers_may_pay("suffix", 1, 1, 8, {False})[0]
