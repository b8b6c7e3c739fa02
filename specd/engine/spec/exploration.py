"""Exploration: where speculation is off, one sequence drafts now and then, so the acceptance
estimates the plan reads stay fresh (docs/architecture.md, "The controller's cost model").

The budget is kept here (earned from verify time, spent on tries, charged what a try's cycle took
beyond its prediction), and the choice of a try: which sequence, which drafter, which k. The plan
(controller.py) asks for a try once it has chosen its k per sequence (Exploration.try_one); the
record (record.py) keeps the budget's books as steps happen.
"""
from __future__ import annotations

from collections import defaultdict

from specd.engine.spec.acceptance import PRIOR_ALPHA, expected_tokens

# Where speculation is off, one sequence drafts at full k now and then so acceptance
# estimates stay fresh; those explorations may spend at most this share of verify time (on
# the demo pair at batch 32 a draft_model exploration of a new sequence costs ~5 ms, the
# drafter catching up on its whole history, against an 18 ms step: exploring every 8th
# step cost 3.5%). The same sequence keeps exploring while it runs, so later explorations
# only catch up on what it generated since.
EXPLORE_SHARE = 0.02


class Exploration:
    def __init__(self):
        # Seconds of verify time not yet spent on exploring, per drafter (each earns an equal share
        # of the budget: one whose tries cost much cannot starve the others).
        self.credit: defaultdict[str | None, float] = defaultdict(float)
        self.names: list[str | None] = [None]  # the drafters of the last plan
        self.seq: int | None = None  # the sequence that explores while it runs

    def grant(self, seconds: float) -> None:
        """Set every drafter's budget (tests: a controller starts with none)."""
        self.credit = defaultdict(lambda: seconds)

    def earn(self, verify_seconds: float) -> None:
        """A forward took verify_seconds: each drafter of the last plan earns its share of EXPLORE_SHARE."""
        for name in self.names:
            self.credit[name] += EXPLORE_SHARE * verify_seconds / len(self.names)

    def overran(self, name: str | None, seconds: float) -> None:
        """A try's cycle took `seconds` more than predicted (the drafter read a whole history, say)."""
        self.credit[name] -= max(0.0, seconds)

    def try_one(self, record, prices, choice: list, fixed: list, seqs: list, base_tokens: int, max_k: int,
                rate: float, plain_s: float, spent_s: float) -> tuple[str | None, float] | None:
        """Let one sequence that is not speculating draft, when the budget allows, with the k that
        would pay best were the drafter as good as the prior (on a CPU, a k that fills a matmul
        tile costs a fraction of max_k), and the drafter with the fewest tries for this sequence
        weighed by what a try costs: a draft model that must first read a long history costs
        many suffix lookups, and waiting for it starved the cheap one. Only drafters whose k
        drafts, were all of them accepted, would raise the step's rate (tokens a second) are
        tried: where not even that pays (a CPU at batch 32, where each verify row costs about
        what a sequence's step does), what a try would learn cannot be used. Nor one that would cost
        some sequence of the step more than its ledger's slack allows (plain_s: a plain step of the
        batch; spent_s: what the step takes beyond it already; a try's drafts are credited to it only
        if accepted). The try goes into choice. -> (its drafter, the seconds charged), or None."""
        idle = [i for i, ((k, _), f) in enumerate(zip(choice, fixed)) if k == 0 and f is None and seqs[i][1] > 0]
        if not idle:
            self.credit.clear()  # nothing to learn: no saving up for a burst
            return None
        i = next((j for j in idle if seqs[j][0] == self.seq), idle[0])
        sid = seqs[i][0]
        tried = record.per_seq.get(sid, {})
        tokens = base_tokens + sum(c[0] for c in choice)

        cap, offered = min(max_k, seqs[i][1]), prices.offered.get(sid, {})
        options = {n: self._option(record, n, tokens, cap, offered.get(n))
                   for n in ([prices.pinned[sid]] if sid in prices.pinned else self.names) if offered.get(n, 1) > 0}
        affordable = [n for n, (cost, k) in options.items() if self.credit[n] >= cost and k > rate * cost]
        if affordable:  # the ledgers are read only where a try is otherwise made (not every plan's work)
            room_s = min(record.ledger.headroom(s) for s, _, _ in seqs) * plain_s - spent_s
            affordable = [n for n in affordable if options[n][0] <= room_s]
        if affordable:
            name = min(affordable, key=lambda n: (1 + (tried[n].tries if n in tried else 0)) * options[n][0])
            cost, k = options[name]
            self.credit[name] = min(self.credit[name] - cost, cost)
            self.seq = sid
            choice[i] = (k, name)
            return name, cost
        return None

    @staticmethod
    def _option(record, name: str | None, tokens: int, cap: int, offered: int | None = None) -> tuple[float, int]:
        """(seconds a try adds to the step, its k) with this drafter: the k of the best step rate
        were its acceptance the prior's (a draft offered already: all of it, its rows the only cost)."""
        if offered is not None:
            k = min(cap, offered)
            return record.verify_cost(tokens + k) - record.verify_cost(tokens), k

        def step_s(k: int) -> float:
            return record.drafter(name).seconds(1, k) + record.verify_cost(tokens + k)

        k = max(range(1, cap + 1), key=lambda k: expected_tokens(PRIOR_ALPHA, k) / max(step_s(k), 1e-9))
        return step_s(k) - record.verify_cost(tokens), k
