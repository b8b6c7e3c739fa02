"""The speculation controller's own cost: a plan that wants plain decoding is reused by the steps
after it, for as long as keeps planning at PLAN_SHARE of the verify time, once plans in a row have
wanted it (1, 3, 7, .. steps), and never where the indexes asked offered nothing."""
from __future__ import annotations

import random

from test_spec_controller import _trained

from specd.engine.spec.controller import MAX_REUSE, PLAN_SHARE, SpecController
from specd.engine.spec.costs import RealizedCalibration


def _plain_planned(plan_s: float, n: int = 32, streak: int = 1) -> SpecController:
    """A controller whose last `streak` plans wanted plain decoding (the reuse between them drained)."""
    c = _trained(lambda t: 0.0005 + 0.001 * t, alpha=0.6 if n > 1 else 0.01, seqs=range(n))
    seqs = [(i, 4, None) for i in range(n)]
    for i in range(streak):
        if i:
            while c.reuse_plain(seqs, n) is not None:
                pass
        assert [k for k, _ in c.plan(seqs, n)] == [0] * n
        c.planned(plan_s, n)
    return c


def _reused(c: SpecController, n: int = 32) -> int:
    seqs = [(i, 4, None) for i in range(n)]
    return sum(1 for _ in iter(lambda: c.reuse_plain(seqs, n), None))


def test_at_batch_1_reuse_grows_with_plans_in_a_row_that_want_plain():
    # A dear plan (1 s: the share alone would allow MAX_REUSE): 0, 1, 3, 7, 15 steps after the 1st..5th.
    assert [_reused(_plain_planned(1.0, n=1, streak=s), n=1) for s in range(1, 7)] == [0, 1, 3, 7, 15, MAX_REUSE]
    # in a batch, at once
    assert _reused(_plain_planned(1.0, n=32, streak=1)) == MAX_REUSE


def test_a_plan_that_wants_speculation_ends_the_streak():
    c = _plain_planned(1.0, n=1, streak=4)
    assert c._plain_streak == 4
    while c.reuse_plain([(0, 4, None)], 1) is not None:
        pass
    for _ in range(200):  # then the index's 8-token offers are accepted whole: the next plan speculates
        c.observe_accept(0, 8, 8, offered=8, source="own")
    assert c.plan([(0, 8, None)], 1, offered={0: {None: 8}}, offer_sources={0: {None: "own"}})[0][0] > 0
    c.planned(1.0, 1)
    assert c._plain_streak == 0


def test_a_streak_does_not_carry_over_from_a_batch():
    c = _plain_planned(1.0, n=1, streak=4)
    seqs = [(i, 4, None) for i in range(32)]
    assert [k for k, _ in c.plan(seqs, 32)] == [0] * 32
    c.planned(1.0, 32)
    while c.reuse_plain(seqs, 32) is not None:
        pass
    assert c.plan([(0, 4, None)], 1)[0][0] == 0
    c.planned(1.0, 1)  # the first plain plan of one sequence again
    assert _reused(c, n=1) == 0


def test_no_reuse_where_the_indexes_asked_offered_nothing():
    c = _plain_planned(1.0)
    seqs = [(i, 4, None) for i in range(32)]
    while c.reuse_plain(seqs, 32) is not None:
        pass
    assert [k for k, _ in c.plan(seqs, 32)] == [0] * 32
    c.planned(1.0, 32, nothing_offered=True)
    assert _reused(c) == 0
    c = _plain_planned(1.0, n=1, streak=4)  # 7 steps after the 4th plain plan in a row
    while c.reuse_plain([(0, 4, None)], 1) is not None:
        pass
    assert c.plan([(0, 4, None)], 1)[0][0] == 0
    c.planned(1.0, 1, nothing_offered=True)
    assert _reused(c, n=1) == 0
    c.plan([(0, 4, None)], 1)
    c.planned(1.0, 1)  # and the streak went on where it was: the 5th
    assert _reused(c, n=1) == 15


def test_a_dear_plain_plan_is_reused_until_planning_costs_its_share():
    c = _plain_planned(0.002)  # 2 ms against a 32.5 ms step: 6 steps reuse it (7 steps, 0.29 ms each)
    seqs = [(i, 4, None) for i in range(32)]
    reused = 0
    while (choice := c.reuse_plain(seqs, 32)) is not None:
        assert [k for k, _ in choice] == [0] * 32 and c.step_mode == "plain"
        assert c._predicted == c.verify_cost(32)  # a plain cycle as calibration times it
        reused += 1
    assert reused == int(0.002 / (PLAN_SHARE * c.verify_cost(32))) == 6
    assert c.reuse_plain(seqs, 32) is None  # and then it plans again


def test_a_cheap_plan_is_made_every_step():
    c = _plain_planned(0.0001)  # 0.1 ms against 32.5 ms: under the share already
    assert c.reuse_plain([(i, 4, None) for i in range(32)], 32) is None


def test_reuse_is_capped():
    c = _plain_planned(1.0)
    seqs = [(i, 4, None) for i in range(32)]
    assert sum(1 for _ in iter(lambda: c.reuse_plain(seqs, 32), None)) == MAX_REUSE


def test_a_request_with_its_own_k_or_another_batch_size_ends_the_reuse():
    c = _plain_planned(0.002)
    assert c.reuse_plain([(i, 4, None) for i in range(31)], 31) is not None  # 31: the same bucket (17-32)
    assert c.reuse_plain([(i, 4, None) for i in range(16)], 16) is None  # another bucket: plan
    assert c.reuse_plain([(i, 4, None) for i in range(32)], 32) is None  # and the reuse is gone
    c = _plain_planned(0.002)
    assert c.reuse_plain([(0, 4, 2)] + [(i, 4, None) for i in range(1, 32)], 32) is None  # a request's own k


def test_a_plan_that_speculates_is_never_reused():
    c = _trained(lambda t: 0.010 + 0.00001 * t, alpha=0.9, seqs=[0])
    assert c.plan([(0, 4, None)], 1)[0][0] > 0
    c.planned(1.0, 1)
    assert c.reuse_plain([(0, 4, None)], 1) is None


def _drive(c: SpecController, steps: int, plan_s: float, spec_s: float, plain_s: float) -> tuple[int, int]:
    """The engine's loop with the Speculator's order (reuse, else plan and report its time): -> (plans
    made, speculative steps)."""
    seqs = [(i, 4, None) for i in range(8)]
    rng, now, plans, spec_steps = random.Random(1), 0.0, 0, 0
    for _ in range(steps):
        c.close_cycle(now)
        choice = c.reuse_plain(seqs, 8)
        if choice is None:
            choice = c.plan(seqs, 8)
            c.planned(plan_s, 8)
            plans += 1
        ks = [k for k, _ in choice]
        for sid, k in enumerate(ks):
            accepted = 0
            while accepted < k and rng.random() < 0.9:
                accepted += 1
            c.observe_accept(sid, k, accepted)
        seconds = spec_s if any(ks) else plain_s
        spec_steps += any(ks)
        c.open_cycle(len(seqs), now, seconds)
        now += seconds
    return plans, spec_steps


def test_probes_of_speculation_stay_spaced_by_cycles_when_plans_are_reused():
    """Speculation predicted to pay but measured slower (60 ms against 8 ms plain cycles): plain is
    wanted and probes of speculation come every so many cycles. A dear plan (reused 15 steps of 16)
    leaves that spacing as it was with plans every step."""
    steps = 3000
    every_step = _drive(_trained(lambda t: 0.010 + 0.00001 * t, alpha=0.9, seqs=range(8)), steps, 0.0, 0.060, 0.008)
    reused = _drive(_trained(lambda t: 0.010 + 0.00001 * t, alpha=0.9, seqs=range(8)), steps, 1.0, 0.060, 0.008)
    assert every_step[0] == steps and reused[0] < steps / 4  # the reuse took most plans away
    assert every_step[1] >= RealizedCalibration.PROBE_CYCLES  # speculation was probed...
    assert abs(reused[1] - every_step[1]) <= RealizedCalibration.PROBE_CYCLES  # ...as often either way
