"""Speculation controller: how many drafts (k) each sequence gets this step, and from which
drafter where several serve (a verifier's pool: e.g. a draft model and a suffix index).

Cost model (docs/architecture.md, "The controller's cost model"), measured online (the acceptance records: acceptance.py):
  verify time  V(T), T = tokens in the forward: measured per T up to VerifyCost.TABLE_MAX (a
               CPU's matmul computes rows in register tiles, so e.g. 1-4 rows cost alike and a
               5th costs a tile more: a line through the points misprices every k), a + b·T
               beyond (least squares, forgetting old steps)
  draft time   D(n) = c + e·n per draft step, n = sequences drafting (proposers draft all
               sequences of a step together, so one exploring sequence costs far less
               than the whole batch: a single per-step number made batch 32 look cheap)
  acceptance   α per sequence (geometric MLE: accepted / (accepted + rejections)), drawn towards
               the drafter's over all sequences of the same kind, greedy or sampled (a draft
               is accepted less often under sampling: one prior for both let a batch of
               sampled requests turn speculation off for the greedy ones after them); the
               sampled one is itself drawn towards the greedy one until it has history
  positions    per drafter and kind, acceptance by position: c_j, the j-th draft accepted where
               the j - 1 before it were, and l_j, a j-th token drafted where j - 1 were and k
               allowed j (geometric α reads every token of a draft as equally likely accepted; a
               suffix index's are not: past its first token a draft that copies a passage is
               accepted ~0.8 per token against ~0.55 for the first, and the index stops drafting
               where its match ends, so a large k costs it only the rows it drafts). Expected
               accepted tokens of a draft capped at k: Σ_{i≤k} Π_{j≤i} l_j·c_j, scaled for a
               sequence by how its own α compares with the drafter's (not a draft offered before
               the plan: pricing.py); verify rows Σ_{i≤k} Π_{j≤i} l_j
               (l_1 = 1: y below is the share with any drafts)
  pipelining   a pipelined drafter answers a share h of proposals from its draft cache: it
               drafted them while the previous step verified, so a hit costs the wait W
               (the round trip, plus whatever drafting ahead outlasted the verify: a hit's
               step takes max(verify, draft)); only misses cost D(n)·k. h and W are measured.
  drafters  D, h, W and α are kept per drafter (α also per sequence and drafter), with y, the
               share of proposals that held drafts (a suffix index drafts only where the text
               repeats; a proposal without drafts costs its round trip and nothing else).
Expected tokens from k drafts: E(k) = 1 + y·(accepted by the positions above) (with no position
measured yet: 1 + y·((1 − α^{k+1}) / (1 − α) − 1), geometric in α). The controller
picks the k, and per sequence the drafter out of a set S of drafters drafting this step
(every subset is tried), that maximise Σ E / (V(T0 + Σ y·rows) + max over S of the drafter's
(1 − h)·D(n)·k + h·W) (drafters of one step answer concurrently), each option's time scaled
by what cycles of its mode really took over what was predicted, and a speculative option's
accepted drafts by what speculative cycles accepted over what was predicted (RealizedCalibration:
the never-slower rule); k = 0 (speculation off)
wins when the target is compute-bound (large batch) or acceptance is low. A sequence changes
drafter only for a clearly better one (DRAFTER_MARGIN): the new drafter reads its whole
history first. Turning speculation on must beat k = 0 by SWITCH_MARGIN: what the model leaves
out (the drafter catching up on a sequence's history when speculation turns on, ragged
finishing of a batch) all costs speculation, so a predicted gain of a few percent is a loss.

The controller is split by what each part does: the record of what happened (record.py: the
observe_* calls, the cycles, the ledger; a SpecController is a SpecRecord that plans from it), the
prices of drafts in one plan (pricing.py), exploration (exploration.py), and here the plan itself:
every k and subset of drafters weighed, a probe of the other mode, the ledgers' slack, the reuse of
a plain plan.
"""
from __future__ import annotations

from specd.engine.spec.costs import RealizedCalibration
from specd.engine.spec.pricing import PlanPrices, offers_may_pay
from specd.engine.spec.record import SpecRecord

MIN_SAMPLES = 8  # verify timings needed before the cost model is trusted
# Measured on the demo pair, 2-core CPU, batch 32: k = 1 was predicted 5% faster than k = 0
# and ran 8% slower; at batch 1 the predicted gains are 30-60%, far above this margin.
SWITCH_MARGIN = 1.10
# Where one sequence decodes and its draft was made before the plan (an in-process index's offer),
# nothing the model leaves out is paid: the drafting is done, no drafter catches up on a history,
# and the rows are the step's only cost, measured per T (VerifyCost's table), the draft's acceptance
# per source and length. The wide margin there left a third of a datastore's offers on chat at
# batch 1 unverified (a 2-core Xeon with AMX, one process: 1607 of 2348 offered tokens verified at
# 1.10, 1936 at 1.02, 2200 with the plain-plan rule of planned() as well). In batches the wide one
# stays: many sequences' rows are priced by a line past the table, and served at 1.02 five batched
# cells lost 3-6% (chat 0.94x at batch 32).
OFFER_SWITCH_MARGIN = 1.02
# A plan costs time of its own (asking the index drafters, weighing every k and drafter for every
# sequence): at batch 32 on a 2-core Xeon, 8% of the engine's step time in a chat run where it
# chose plain decoding nearly every step (py-spy), which the server's choice then lost against
# plain requests. While plain decoding is what a plan wants, the steps after it reuse that answer,
# enough of them that planning takes at most PLAN_SHARE of the verify time (few or none at batch 1,
# where a plan weighs one sequence), at most MAX_REUSE in a row.
PLAN_SHARE = 0.01
MAX_REUSE = 16


class SpecController(SpecRecord):
    def __init__(self, max_k: int, adaptive: bool = True):
        super().__init__()
        self.max_k, self.adaptive = max_k, adaptive
        self.prices = PlanPrices(self, max_k, [None], {}, {}, {})  # the last plan's (tests read its curves)
        self.slack_plain_steps = 0  # steps the plan wanted to speculate in and the ledger kept plain
        self._wanted_plain = False  # the last plan wanted plain decoding and ran it (not a probe)
        self._plain_streak = 0  # one-sequence plans in a row that wanted plain decoding (planned())
        self._reuse: tuple[int, int] | None = None  # (batch-size bucket, steps left) that reuse a plain plan
        self._planned_seqs = 0  # sequences of the last plan
        # The last plan's rates (tokens a second) for the debug log: plain's, and the best speculative
        # option's (its k, raw and calibrated); None where the model did not choose.
        self.rates: tuple | None = None

    def choose(self, seqs: list[tuple[int, int, int | None]], base_tokens: int) -> list[int]:
        """k per sequence, where one proposer drafts (plan() with a single drafter)."""
        return [k for k, _ in self.plan(seqs, base_tokens)]

    def plan(self, seqs: list[tuple[int, int, int | None]], base_tokens: int,
             drafters: list[str | None] | None = None,
             pinned: dict[int, str] | None = None,
             offered: dict[int, dict[str | None, int]] | None = None,
             offer_sources: dict[int, dict[str | None, str]] | None = None) -> list[tuple[int, str | None]]:
        """seqs: (seq_id, cap, override) per decoding sequence → (k, drafter) per sequence.

        cap bounds k by max_tokens / max_model_len / KV room; override is the request's
        own num_speculative_tokens (None: ours to choose; 0: off). drafters: those that may
        draft this step, in the order to prefer on a tie (None: the engine's one proposer);
        pinned: sequences whose request named its drafter; offered: drafts already made before the
        plan, by sequence, the length each in-process index drafter offered (0: none). Such a
        drafter's draft costs nothing more, its rows are known, and its acceptance is read by the
        length offered (a k below it verifies the draft's first k tokens) and, where the index names
        them, the source that drafted it (offer_sources).
        """
        names = list(drafters) if drafters else [None]
        self.exploration.names = names
        self._wanted_plain, self._planned_seqs = False, len(seqs)
        self._predicted_accepted, self._accepted = 0.0, 0
        self._sampled_step = any(self.sampled.get(sid, False) for sid, _, _ in seqs)
        self.prices = PlanPrices(self, self.max_k, names, pinned or {}, offered or {}, offer_sources or {})
        fixed = [min(o, cap) if o is not None else None for _, cap, o in seqs]
        self.rates = None
        if not self.adaptive or self.verify_cost.n < MIN_SAMPLES:
            self.step_mode = "untimed"  # calibration learns nothing from steps the model did not choose
            self._book(seqs, 0.0)  # not priced: the warm-up's steps, or no controller at all
            return [(f if f is not None else min(self.max_k, cap),
                     self.prices.pinned.get(sid) or self.current.get(sid, names[0]))
                    for f, (sid, cap, _) in zip(fixed, seqs)]
        if all(f is not None for f in fixed):  # every request set its own k: nothing to choose
            choice, _, self._predicted, _ = self._rate(seqs, fixed, 0, names[:1], base_tokens)
            self.step_mode = "untimed" if any(fixed) else "plain"
            self._book(seqs, 0.0)  # the requests' own choice, not the controller's
            return choice
        n = len(seqs)
        scale = {k > 0: self.calibration.scale(n, "spec" if k else "plain") for k in (0, 1)}
        extra = self.calibration.extra_scale(n, self._sampled_step)  # accepted drafts realized over predicted
        best, best_rate, raw_best, plain, plain_rate = self._weigh(seqs, fixed, names, base_tokens, scale, extra)
        wanted = "spec" if best[0] else "plain"
        mode = self.calibration.mode(n, wanted, spec_may_pay=raw_best[0] > 0,
                                     probe_loss=self._probe_loss(wanted, best, best_rate, raw_best, plain, plain_rate, scale))
        if mode != wanted:  # a probe of the other mode
            best = (raw_best[0], raw_best[2], raw_best[3]) if mode == "spec" else (0, plain, names[:1])
        self._wanted_plain = wanted == mode == "plain"
        if wanted == "spec":
            self._plain_streak = 0
        option = best[1]
        plain_s = plain[2] / scale[False]  # a plain step of this batch, as calibrated
        if not any(fixed) and any(k for k, _ in option[0]):
            option = self._within_slack(seqs, fixed, best[0], best[2], option, plain, plain_s, scale[True], extra,
                                        base_tokens)
        choice, expected, self._predicted, _ = option
        self._predicted_accepted = expected - n
        # Requests with their own k are neither plain nor the controller's choice: not timed.
        self.step_mode = ("untimed" if any(fixed) else
                          "spec" if any(k for k, _ in choice) else "plain")
        step_s = self._predicted / scale[self.step_mode == "spec"]
        self._explored = self.exploration.try_one(self, self.prices, choice, fixed, seqs, base_tokens, self.max_k,
                                                  expected / max(self._predicted, 1e-9), plain_s,
                                                  max(step_s - plain_s, 0.0))
        if self._explored is not None:
            step_s += self._explored[1]
            self._explored = (*self._explored, self.step_mode)  # and the mode of the step it joined
            self.step_mode = "explore"
        self._book(seqs, step_s / plain_s - 1.0 if self.step_mode != "untimed" and plain_s > 0 else 0.0)
        return choice

    def _weigh(self, seqs, fixed, names: list[str | None], base_tokens: int, scale: dict, extra: float):
        """Every option of the step rated: plain decoding, and each k > 0 with each subset of drafters.
        -> (the best calibrated (k, option, subset), its rate, the best raw (k, rate, option, subset),
        plain's option, its calibrated rate); self.rates for the debug log."""
        n = len(seqs)
        offered = self.prices.offered
        best, best_rate, raw_best, plain, plain_rate = None, -1.0, None, None, 0.0
        spec_best = (0, 0.0, 0.0)  # the best speculative option: (k, raw rate, calibrated rate)
        # Where every drafter's draft is made before the plan (in-process indexes only), a draft is
        # taken whole whatever the step's k: k = 1 is every k > 0 (the other 7 of 9 options cost
        # most of a plan at batch 32).
        k_matters = any(name not in offered.get(sid, {}) for sid, cap, _ in seqs if cap > 0 for name in names)
        # One sequence drafts with one drafter: a subset of several prices what its best single one
        # does; and a subset whose every drafter offered its draft prices every k > 0 alike. Left out,
        # a plan at batch 1 with the default stack's two drafters took 0.30 ms, ~2% of a step.
        subsets = _subsets(names) if n > 1 else [[name] for name in names]
        offered_by_all = {name for name in names
                          if all(name in offered.get(sid, {}) for sid, cap, _ in seqs if cap > 0)}
        for k in range(self.max_k + 1 if k_matters else min(self.max_k, 1) + 1):
            for subset in [s for s in subsets if k <= 1 or not set(s) <= offered_by_all] if k else [names[:1]]:
                option = self._rate(seqs, fixed, k, subset, base_tokens)
                raw = option[1] / option[2] if option[2] > 0 else option[1]
                margin = OFFER_SWITCH_MARGIN if n == 1 and self._all_offered(option[0], seqs) else SWITCH_MARGIN
                # Calibrated: the time by what cycles of its mode took, the drafts' tokens by what they made.
                tokens = n + (option[1] - n) * extra if k else option[1]
                rate = (tokens / option[2] if option[2] > 0 else tokens) * scale[k > 0]
                if plain is None:
                    plain, plain_rate = option, rate
                elif rate > spec_best[2]:
                    spec_best = (k, raw, rate)
                # Turning speculation on must clearly pay; among k > 0 prefer the smaller when close.
                if rate > best_rate * (margin if best is None or best[0] == 0 else 1.01):
                    best, best_rate = (k, option, subset), rate
                if raw_best is None or raw > raw_best[1] * (margin if raw_best[0] == 0 else 1.01):
                    raw_best = (k, raw, option, subset)
        self.rates = (plain[1] / plain[2] if plain[2] > 0 else 0.0, plain_rate, *spec_best)
        return best, best_rate, raw_best, plain, plain_rate

    def _within_slack(self, seqs, fixed, k, subset, option, plain, plain_s: float, spec_scale: float,
                      extra: float, base_tokens: int):
        """This speculative option, or as much of it as keeps every sequence within its ledger's
        slack (ledger.py): first the drafting sequences whose own drafts would not pay for the
        step's time stay plain, then, should a sequence still lose more than it may, the whole step
        does (the rows of a step cost every sequence in it)."""
        for attempt in range(2):
            choice, _, seconds, gains = option
            extra_steps = seconds / spec_scale / plain_s - 1.0 if plain_s > 0 else 0.0
            over = [i for i, (sid, _, _) in enumerate(seqs)
                    if not self.ledger.fits(sid, extra_steps, gains.get(i, 0.0) * extra)]
            if not over:
                return option
            drafting = [i for i in over if choice[i][0] > 0]
            if attempt or len(drafting) < len(over):
                break
            fixed = list(fixed)
            for i in drafting:
                fixed[i] = 0
            option = self._rate(seqs, fixed, k, subset, base_tokens)
            if not any(ki for ki, _ in option[0]):
                break
        self.slack_plain_steps += 1
        self._wanted_plain = False  # not a plan to reuse: speculation may fit again next step
        return plain

    def _book(self, seqs: list, extra_steps: float) -> None:
        """Every sequence of this step decodes in a step that costs it extra_steps plain steps beyond
        one (the drafts it has accepted are credited as they come: observe_accept)."""
        for sid, _, _ in seqs:
            self.ledger.charge(sid, extra_steps)

    def _all_offered(self, choice: list[tuple[int, str | None]], seqs: list) -> bool:
        """Whether every sequence that drafts in this choice takes a draft offered before the plan."""
        return all(name in self.prices.offered.get(sid, {}) for (k, name), (sid, _, _) in zip(choice, seqs) if k > 0)

    def planned(self, seconds: float, base_tokens: int, nothing_offered: bool = False) -> None:
        """The plan just made took `seconds` (with the index drafters' offers): where it wanted plain
        decoding, the next steps reuse it (reuse_plain) for as long as keeps planning at PLAN_SHARE.
        Not where it was plain only because the indexes asked offered nothing (nothing_offered), and
        for one sequence only after plans in a row that wanted plain (1, 3, 7, .. steps after the
        2nd, 3rd, 4th, ..): an index's match follows the text, so the step after a priced-out or
        missing offer may well hold one that pays (on chat at batch 1, a 2-core Xeon, reusing single
        plain plans skipped the offers of 80-380 of ~1000 steps). In batches a plan and its offers
        cost many times more (at batch 32, 8% of a step before reuse), and the reuse starts at once."""
        self._reuse = None
        if self._planned_seqs != 1:
            self._plain_streak = 0  # a streak is one sequence's: one from a batch does not carry over
        if self._wanted_plain and self.step_mode == "plain" and not nothing_offered:
            steps = int(seconds / max(PLAN_SHARE * self.verify_cost(base_tokens), 1e-9))
            if self._planned_seqs == 1:  # in batches a plan and its offers cost more: reuse at once
                self._plain_streak += 1
                steps = min(steps, 2 ** min(self._plain_streak - 1, 8) - 1)
            if steps > 0:
                self._reuse = (RealizedCalibration.bucket(self._planned_seqs), min(steps, MAX_REUSE))

    def reuse_plain(self, seqs: list[tuple[int, int, int | None]], base_tokens: int) -> list[tuple[int, str | None]] | None:
        """k = 0 for every sequence without planning, where the last plan wanted plain decoding and
        may still be reused (planned): the batch size in the same bucket, and no request setting its
        own k. None: plan. The step is a plain cycle for calibration, and counts towards its next
        probe of speculation (probes stay spaced by cycles)."""
        if self._reuse is None:
            return None
        bucket, left = self._reuse
        n = len(seqs)
        if left <= 0 or bucket != RealizedCalibration.bucket(n) or any(o is not None for _, _, o in seqs):
            self._reuse = None
            return None
        self._reuse = (bucket, left - 1)
        self.calibration.skipped(n)
        self._book(seqs, 0.0)
        self.prices, self._explored = PlanPrices(self, self.max_k, self.exploration.names, {}, {}, {}), None
        self._predicted_accepted, self._accepted = 0.0, 0
        self._predicted = self.verify_cost(base_tokens)
        self.step_mode = "plain"
        return [(0, self.current.get(sid)) for sid, _, _ in seqs]

    def offers_may_pay(self, name: str | None, num_seqs: int, base_tokens: int, cap: int,
                       kinds: set[bool]) -> tuple[bool, frozenset[str]]:
        """Whether this in-process drafter's offers could pay at this batch size, and the sources of
        it none of whose could (pricing.offers_may_pay); before the cost model is trusted, all may."""
        if not self.adaptive or self.verify_cost.n < MIN_SAMPLES:
            return True, frozenset()
        return offers_may_pay(self, name, num_seqs, base_tokens, cap, kinds)

    @staticmethod
    def _probe_loss(wanted, best, best_rate, raw_best, plain, plain_rate, scale) -> float:
        """Cycles of the wanted mode a cycle of the other loses, as the calibrated model sees it:
        its time over the wanted one's times the share of the rate it gives up."""
        if wanted == "plain":
            probe_s, probe_rate = raw_best[2][2] / scale[True], raw_best[1] * scale[True]
        else:
            probe_s, probe_rate = plain[2] / scale[False], plain_rate
        wanted_s = best[1][2] / scale[wanted == "spec"]
        if best_rate <= 0 or wanted_s <= 0:
            return 0.0
        return probe_s / wanted_s * max(0.0, 1.0 - probe_rate / best_rate)

    def _rate(self, seqs, fixed, k: int, subset: list[str | None], base_tokens: int):
        """(k, drafter) per sequence with drafters from subset -> (that choice, tokens expected,
        seconds expected, accepted drafts expected by index of the sequences that draft)."""
        choice, tokens, verify_tokens = [], 0.0, float(base_tokens)
        load: dict[str | None, tuple[int, int]] = {}  # drafter -> (sequences, largest k)
        drafting_seqs: dict[int, tuple[float, float]] = {}  # by index: (tokens drafted, share of proposals with drafts)
        offers: list[tuple[int, float]] = []  # (index, accepted tokens expected) of drafts made before the plan
        gains: dict[int, float] = {}  # by index: accepted tokens expected of each drafting sequence
        for i, (f, (sid, cap, _)) in enumerate(zip(fixed, seqs)):
            ki = f if f is not None else min(k, cap)
            if ki <= 0:
                choice.append((0, self.current.get(sid, subset[0])))
                tokens += 1.0
                continue
            # A draft made before the plan is taken whole (up to the cap) wherever the step drafts: the
            # step's k is one for all, and cutting a long copy to a model drafter's k lost its tail.
            whole = ki if f is not None else cap
            name, gain, made, rows = self.prices.best_drafter(sid, ki, subset, whole)
            if name in self.prices.offered.get(sid, {}):  # drafted already: nothing to wait for, an empty draft is plain
                if not made:
                    choice.append((0, self.current.get(sid, subset[0])))
                    tokens += 1.0
                    continue
                ki = int(rows)  # all it offered, up to the cap
                if f is None:
                    offers.append((i, gain))
            else:
                n, most = load.get(name, (0, 0))
                load[name] = (n + 1, max(most, ki))
            choice.append((ki, name))
            tokens += 1.0 + gain
            gains[i] = gain
            verify_tokens += made * rows
            drafting_seqs[i] = (rows, made)
        drafting = max((self.drafter(d).seconds(n, most) for d, (n, most) in load.items()), default=0.0)
        # A draft made before the plan is verified only where its tokens pay for its rows at the
        # step's rate: the plan's k is one for the whole step, and without this a one-token guess
        # rarely right would ride along with another sequence's long copy.
        for i, gain in offers:
            rows = drafting_seqs[i][0]
            step_s = self.verify_cost(verify_tokens) + drafting
            if gain * step_s < tokens * (self.verify_cost(verify_tokens) - self.verify_cost(verify_tokens - rows)):
                choice[i] = (0, self.current.get(seqs[i][0], subset[0]))
                tokens, verify_tokens = tokens - gain, verify_tokens - rows
                del drafting_seqs[i], gains[i]
        if len(drafting_seqs) == 1:
            # One sequence drafts: its forward has base + k tokens or base, not the mean between
            # (on a CPU those two can differ by a whole matmul tile, the mean by none).
            ((rows, made),) = drafting_seqs.values()
            verify = made * self.verify_cost(base_tokens + rows) + (1 - made) * self.verify_cost(base_tokens)
        else:
            verify = self.verify_cost(verify_tokens)
        return choice, tokens, verify + drafting, gains


def _subsets(names: list) -> list[list]:
    """Every non-empty subset of names, in order (a pool holds a few drafters; beyond 4, the
    single drafters and all of them)."""
    if len(names) > 4:
        return [[n] for n in names] + [names]
    return [[n for j, n in enumerate(names) if mask >> j & 1] for mask in range(1, 1 << len(names))]
