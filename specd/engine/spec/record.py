"""What speculation did, as the controller (controller.py) plans from it: verify and draft times,
acceptance per drafter and per sequence, what each step's cycle really took against its plan
(calibration), what speculation cost each request (the ledger), and the exploration budget's books.

SpecRecord is only written by what happened (observe_*, the cycles) and read by the plan; it
never reads the plan's own state. The step's prediction (step_mode, _predicted, ...) is the one
thing the plan writes here: the cycle it opens compares it with what the step took.
"""
from __future__ import annotations

from specd.engine.spec.acceptance import PRIOR_ALPHA, DrafterStats, Positions, SeqDrafterStats
from specd.engine.spec.costs import RealizedCalibration, VerifyCost
from specd.engine.spec.exploration import Exploration
from specd.engine.spec.ledger import RequestLedger


class SpecRecord:
    def __init__(self):
        self.verify_cost = VerifyCost()
        self.drafters: dict[str | None, DrafterStats] = {}  # None: the one proposer of an engine
        self.per_seq: dict[int, dict[str | None, SeqDrafterStats]] = {}
        self.current: dict[int, str | None] = {}  # the drafter each sequence drafted with last
        self.sampled: dict[int, bool] = {}  # sequences that sample (temperature > 0): note_sampling
        self.exploration = Exploration()
        self.calibration = RealizedCalibration()
        self.ledger = RequestLedger()  # what speculation cost each sequence: the per-request rule
        # This step as the plan predicted it, for its cycle (open_cycle):
        self._predicted = 0.0  # seconds the model expects this step's plan to take
        self._cycle: tuple | None = None
        self._explored: tuple | None = None  # this step's exploration: (drafter, seconds charged, mode it joined)
        self._predicted_accepted = 0.0  # drafts this step's plan expects accepted (calibration.extra)
        self._sampled_step = False  # a sequence of this step's plan samples (calibration.extra's kind)
        self._accepted = 0  # drafts accepted in this step so far (observe_accept)
        self.step_mode = "plain"  # this step as calibration sees it: plain, spec, or explore / untimed (not timed)

    def grant_exploration(self, seconds: float) -> None:
        """Set every drafter's exploration budget (tests: a controller starts with none)."""
        self.exploration.grant(seconds)

    def drafter(self, name: str | None = None) -> DrafterStats:
        d = self.drafters.get(name)
        if d is None:  # not setdefault: that builds a DrafterStats on every call, and plan() calls this often
            d = self.drafters[name] = DrafterStats()
        return d

    # -- what the estimates read ---------------------------------------------------
    def estimates(self, sid: int, name: str | None) -> tuple[float, float]:
        """(acceptance per token, share of proposals with drafts) of this sequence with this drafter:
        its own history, drawn towards the drafter's over all sequences."""
        d = self.drafter(name)
        alpha_prior = self.alpha_prior(sid, d)
        made_prior = d.made.alpha(1.0)
        mine = self.per_seq.get(sid, {}).get(name)
        if mine is None:
            return alpha_prior, made_prior
        return mine.acceptance.alpha(alpha_prior), mine.made.alpha(made_prior)

    def alpha_prior(self, sid: int, d: DrafterStats) -> float:
        """The drafter's α over all sequences of this one's kind. A sampled sequence's prior starts
        from what greedy ones accepted, not from PRIOR_ALPHA: a draft is accepted less often under
        sampling, and a sampled batch that started from 0.6 speculated on 3,540 draft-model steps
        at batch 32 (0.60x of plain) before it learned."""
        return self.alpha_prior_of(d, self.sampled.get(sid, False))

    @staticmethod
    def alpha_prior_of(d: DrafterStats, sampled: bool) -> float:
        greedy = d.acceptance[False].alpha(PRIOR_ALPHA)
        return d.acceptance[True].alpha(greedy) if sampled else greedy

    # -- cycles: what a step took against what its plan predicted ---------------------
    def not_timed(self) -> None:
        """This step's cycle says nothing of what its mode costs (a drafter reads a whole history in
        it): calibration leaves it out. An exploration stays charged for what its cycle took."""
        if self.step_mode in ("plain", "spec"):
            self.step_mode = "untimed"

    def open_cycle(self, num_seqs: int, start: float, compute_s: float) -> None:
        """A decode-only step of num_seqs sequences began at `start` and computed for compute_s;
        its cycle ends when the next step begins (close_cycle)."""
        self._cycle = (num_seqs, self.step_mode, start, compute_s, self._predicted,
                       self._explored if self.step_mode == "explore" else None, self._accepted,
                       self._predicted_accepted, self._sampled_step)

    def close_cycle(self, now: float) -> None:
        cycle, self._cycle = self._cycle, None
        if cycle is None:
            return
        num_seqs, mode, start, compute_s, predicted, explored, accepted, predicted_accepted, sampled = cycle
        if now - start > 2 * compute_s + 0.05:  # the engine waited for work, not an overhead
            return
        self.calibration.observe(num_seqs, mode, now - start, predicted, accepted, predicted_accepted, sampled)
        if explored is not None:
            # An exploration costs what its cycle took beyond the step it joined, not what was predicted:
            # the prediction leaves out the drafter reading the sequence's whole history (a draft
            # model at 1 thread, on cores the verifier computes on), so the budget overran.
            name, charged, joined = explored
            ratio = self.calibration.get(num_seqs, joined).value if joined in ("plain", "spec") else 1.0
            self.exploration.overran(name, (now - start) - predicted * ratio - charged)

    # -- observations ------------------------------------------------------------
    def observe_verify(self, tokens: int, seconds: float) -> None:
        self.verify_cost.observe(tokens, seconds)
        self.exploration.earn(seconds)

    def draft_seconds(self, num_seqs: int, k: int, name: str | None = None) -> float:
        return self.drafter(name).seconds(num_seqs, k)

    def observe_draft(self, steps: int, num_seqs: int, seconds: float, cached: float = 0.0,
                      name: str | None = None, one_forward: bool = False) -> None:
        """A propose call: `steps` draft steps (the largest k; 1 for a drafter that drafts in one
        forward) over `num_seqs` sequences, a share `cached` of them answered from a pipelined
        drafter's draft cache."""
        if steps <= 0 or num_seqs <= 0:
            return
        d = self.drafter(name)
        d.one_forward = one_forward
        d.hit_rate = 0.9 * d.hit_rate + 0.1 * cached
        if cached >= 1.0:
            d.hit_wait = seconds if d.hit_wait == 0.0 else 0.9 * d.hit_wait + 0.1 * seconds
        elif cached == 0.0:
            d.cost.observe(num_seqs, seconds / steps)

    def observe_proposal(self, seq_id: int, name: str | None, made: bool, drafted: int | None = None,
                         asked: int | None = None) -> None:
        """A sequence asked `name` for drafts and got some (made) or none; drafted of asked tokens
        (a chain's length, a tree's depth) where the caller knows them."""
        self.current[seq_id] = name
        if made and drafted is not None and asked is not None:
            self.drafter(name).positions[self.sampled.get(seq_id, False)].observe_drafted(drafted, asked)
        mine = self.per_seq.setdefault(seq_id, {}).setdefault(name, SeqDrafterStats())
        mine.tries += 1
        for acc in (mine.made, self.drafter(name).made):
            acc.observe(float(made), 1.0)

    def observe_accept(self, seq_id: int, num_draft: int, num_accepted: int, name: str | None = None,
                       offered: int = 0, source: str = "") -> None:
        """num_draft tokens verified, num_accepted of them accepted; offered: the length of the
        draft they were cut from, where it was offered before the plan, by the index's `source`."""
        if num_draft == 0:
            return
        self._accepted += num_accepted
        self.ledger.credit(seq_id, num_accepted)
        trials = num_accepted + (1 if num_accepted < num_draft else 0)
        mine = self.per_seq.setdefault(seq_id, {}).setdefault(name, SeqDrafterStats())
        sampled = self.sampled.get(seq_id, False)
        for acc in (mine.acceptance, self.drafter(name).acceptance[sampled]):
            acc.observe(num_accepted, trials)
        self.drafter(name).positions[sampled].observe_accept(num_draft, num_accepted)
        if offered:
            by_length = self.drafter(name).by_length[sampled]
            by_length.setdefault((source, offered), Positions()).observe_accept(num_draft, num_accepted)

    def note_sampling(self, seq_id: int, sampled: bool) -> None:
        """Whether this sequence samples (its acceptance counts towards the drafter's sampled prior)."""
        self.sampled[seq_id] = sampled

    def release(self, seq_id: int) -> None:
        self.ledger.release(seq_id)
        self.per_seq.pop(seq_id, None)
        self.current.pop(seq_id, None)
        self.sampled.pop(seq_id, None)
