"""Each request's account of what speculation has cost it: the controller's per-request
never-slower rule (docs/architecture.md, "The controller's cost model").

The controller picks the option of most tokens a second for the whole step, which counts every
accepted draft as throughput. That holds where a finished stream's slot goes to a waiting request;
it does not for the streams of a step that do not draft: a speculative step makes each of them
wait for the drafting streams' rows. At the end of a wave of 32 code edits (2-core Xeon without
AMX, 2026-11-29) 15 steps where 9 of the streams drafted took 1.8x a plain step, and the streams
that did not draft ran ~6% longer over their 200 steps, which no tokens of theirs paid back.

So each sequence keeps an account in plain steps: `lost`, the time its steps took beyond what
plain steps of its batch would have (as the calibrated cost model prices them), less the drafts
of its own that were accepted; and `made`, the tokens it decoded. A step may speculate (or
explore, or probe) only where, for every sequence in it, the loss after the step, its own drafts
counted as the plan expects them, stays within SLACK of the tokens made by then; gains bank, so a
request whose drafts paid may later wait for others'. A request's decode time is then at most
1 + SLACK of plain decoding's at every token, as the model prices it, give or take the drafts of
its last speculative step (counted as expected before it, as accepted after), and the plan's own
time (PLAN_SHARE) comes on top.

Drafts are credited as they were accepted, not as expected: the rule is about what each request
got. Booked as expected, a request whose drafts kept failing where others' were accepted went on
paying for the step's rows: in one process, code edits at batch 8 (bench/per_request.py, modeled
time), the slowest request took 1.3x and 1.4x its plain time in two rounds, 1.03x in both with
drafts credited as accepted (without the rule 1.1x-1.7x and 1.03-1.04x in those two runs: a batch's mix
moves this much from run to run). The price: a sequence whose draft failed may keep its batch
plain until its plain tokens earn the slack back.
"""
from __future__ import annotations

# 0.02 + the plan's 0.01 (controller.PLAN_SHARE) keeps a request at 0.97x of plain decoding
# or better, the bound the issue of faster-by-default set.
SLACK = 0.02


class RequestLedger:
    def __init__(self) -> None:
        self.lost: dict[int, float] = {}  # plain steps of time lost, less drafts accepted
        self.made: dict[int, float] = {}  # tokens decoded

    def headroom(self, seq_id: int) -> float:
        """Plain steps this sequence may still lose in its next step (before that step's tokens)."""
        return SLACK * (self.made.get(seq_id, 0.0) + 1.0) - self.lost.get(seq_id, 0.0)

    def fits(self, seq_id: int, extra_steps: float, gain: float = 0.0) -> bool:
        """Whether a step costing this sequence extra_steps plain steps beyond one, and expected to
        accept `gain` of its drafts, keeps it within SLACK."""
        return extra_steps - gain * (1.0 + SLACK) <= self.headroom(seq_id)

    def charge(self, seq_id: int, extra_steps: float) -> None:
        """A decode step of this sequence takes extra_steps plain steps beyond one (0: a plain step)."""
        self.lost[seq_id] = self.lost.get(seq_id, 0.0) + extra_steps
        self.made[seq_id] = self.made.get(seq_id, 0.0) + 1.0

    def credit(self, seq_id: int, accepted: int) -> None:
        """Drafts of this sequence accepted in its step: tokens it would have taken a step each."""
        self.lost[seq_id] = self.lost.get(seq_id, 0.0) - accepted
        self.made[seq_id] = self.made.get(seq_id, 0.0) + accepted

    def release(self, seq_id: int) -> None:
        self.lost.pop(seq_id, None)
        self.made.pop(seq_id, None)
