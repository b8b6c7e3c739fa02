"""The per-request never-slower rule: no sequence waits for other sequences' drafts beyond its slack."""
from __future__ import annotations

import random

from specd.engine.spec.controller import SpecController
from specd.engine.spec.ledger import SLACK
from test_spec_controller import _offering_drafter


def verify(tokens: int) -> float:
    """A CPU at 9 sequences: each draft row costs 0.9% of a plain step (24 rows: a fifth)."""
    return 0.030 + 0.0003 * tokens


def _index_controller() -> SpecController:
    """A controller that has seen an in-process index's 8-token drafts accepted whole 9 times in 10."""
    return _offering_drafter(verify, {("own", 8): 0.9}, rounds=300, max_t=80)


def _wave(c: SpecController, copying: set[int], streams: int = 9, tokens: int = 200,
          accepted_whole: float = 0.9) -> dict[int, float]:
    """A wave of streams that each decode `tokens` tokens, those in `copying` with an index draft of
    8 tokens every step (accepted whole at the rate given, else none of it), the others with none.
    Time is the forward's (verify of the tokens the plan put in it), not the controller's
    prediction. -> each stream's finishing time."""
    rng = random.Random(2)
    left = {sid: tokens for sid in range(streams)}
    now, done = 0.0, {}
    while left:
        seqs = [(sid, min(8, n - 1), None) for sid, n in left.items()]
        offered = {sid: {"suffix": 8 if sid in copying else 0} for sid in left}
        sources = {sid: {"suffix": "own"} for sid in left}
        plan = c.plan(seqs, len(seqs), ["suffix"], offered=offered, offer_sources=sources)
        now += verify(len(seqs) + sum(k for k, _ in plan))
        for (sid, _, _), (k, _) in zip(seqs, plan):
            accepted = k if k and rng.random() < accepted_whole else 0
            if k:
                c.observe_accept(sid, k, accepted, "suffix", offered=8, source="own")
            left[sid] -= 1 + accepted
            if left[sid] <= 0:
                del left[sid]
                done[sid] = now
                c.release(sid)
    return done


def test_streams_that_do_not_draft_wait_for_others_drafts_no_more_than_the_slack():
    """3 of 9 streams copy their prompt, 6 draft nothing. A step where the 3 verify 8 drafts each
    makes 9 + 21.6 tokens in 1.2x a plain step's time: the rate test takes it every step, and the 6
    would each wait 1.2x plain decoding for their 200 tokens. Each may lose at most SLACK: the 6 end
    within it, and the 3 still speculate (a step in ten), ending well before plain decoding would."""
    c = _index_controller()
    done = _wave(c, copying={0, 1, 2})
    plain = 200 * verify(9)  # every stream's 200 tokens in plain steps of the 9
    assert len(done) == 9
    for sid in range(3, 9):
        assert done[sid] <= plain * (1 + SLACK) + verify(9 + 24), (sid, done[sid] / plain)
    assert max(done[sid] for sid in range(3)) < 0.75 * plain
    assert c.slack_plain_steps > 0  # the rule, not the plan's rate test, kept those steps plain


def test_a_stream_that_drafts_alone_is_not_held_back():
    """Every stream copies, and its drafts are right: speculating costs nobody anything its own drafts
    do not pay back, so the rule never keeps a step plain."""
    c = _index_controller()
    done = _wave(c, copying=set(range(9)), accepted_whole=1.0)
    assert max(done.values()) < 0.5 * 200 * verify(9)
    assert c.slack_plain_steps == 0

