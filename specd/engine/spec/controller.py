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
               the plan: _offered_curve); verify rows Σ_{i≤k} Π_{j≤i} l_j
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
"""
from __future__ import annotations

from collections import defaultdict

from specd.engine.spec.acceptance import DrafterStats, Positions, SeqDrafterStats, expected_tokens
from specd.engine.spec.costs import RealizedCalibration, VerifyCost
from specd.engine.spec.ledger import RequestLedger

PRIOR_ALPHA = 0.6  # acceptance assumed for a sequence before it has any history
MIN_SAMPLES = 8  # verify timings needed before the cost model is trusted
# Where speculation is off, one sequence drafts at full k now and then so acceptance
# estimates stay fresh; those explorations may spend at most this share of verify time (on
# the demo pair at batch 32 a draft_model exploration of a new sequence costs ~5 ms, the
# drafter catching up on its whole history, against an 18 ms step: exploring every 8th
# step cost 3.5%). The same sequence keeps exploring while it runs, so later explorations
# only catch up on what it generated since.
EXPLORE_SHARE = 0.02
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
DRAFTER_MARGIN = 1.10
# A plan costs time of its own (asking the index drafters, weighing every k and drafter for every
# sequence): at batch 32 on a 2-core Xeon, 8% of the engine's step time in a chat run where it
# chose plain decoding nearly every step (py-spy), which the server's choice then lost against
# plain requests. While plain decoding is what a plan wants, the steps after it reuse that answer,
# enough of them that planning takes at most PLAN_SHARE of the verify time (few or none at batch 1,
# where a plan weighs one sequence), at most MAX_REUSE in a row.
PLAN_SHARE = 0.01
MAX_REUSE = 16


class SpecController:
    def __init__(self, max_k: int, adaptive: bool = True):
        self.max_k, self.adaptive = max_k, adaptive
        self.verify_cost = VerifyCost()
        self.drafters: dict[str | None, DrafterStats] = {}  # None: the one proposer of an engine
        self._ranked_by: dict[tuple[int, int], list] = {}  # this plan's drafters per (sequence, k): _ranked
        self._curves: dict[tuple, list] = {}  # this plan's position curves per (drafter, kind): _curve
        self.per_seq: dict[int, dict[str | None, SeqDrafterStats]] = {}
        self.current: dict[int, str | None] = {}  # the drafter each sequence drafted with last
        self.sampled: dict[int, bool] = {}  # sequences that sample (temperature > 0): note_sampling
        # Seconds of verify time not yet spent on exploring, per drafter (each earns an equal share
        # of the budget: one whose tries cost much cannot starve the others).
        self.explore_credit: defaultdict[str | None, float] = defaultdict(float)
        self._explore_names: list[str | None] = [None]  # the drafters of the last plan
        self.explore_seq: int | None = None  # the sequence that explores while it runs
        self.pinned: dict[int, str] = {}  # this step's sequences whose request named its drafter
        self.offered: dict[int, dict[str | None, int]] = {}  # this step's drafts made before the plan: lengths
        self.offer_sources: dict[int, dict[str | None, str]] = {}  # and which source of the index made each
        self.calibration = RealizedCalibration()
        self.ledger = RequestLedger()  # what speculation cost each sequence: the per-request rule
        self.slack_plain_steps = 0  # steps the plan wanted to speculate in and the ledger kept plain
        self._predicted = 0.0  # seconds the model expects this step's plan to take
        self._cycle: tuple | None = None
        self._explored: tuple | None = None  # this step's exploration: (drafter, seconds charged, mode it joined)
        self._predicted_accepted = 0.0  # drafts this step's plan expects accepted (calibration.extra)
        self._sampled_step = False  # a sequence of this step's plan samples (calibration.extra's kind)
        self._accepted = 0  # drafts accepted in this step so far (observe_accept)
        self.step_mode = "plain"  # this step as calibration sees it: plain, spec, or explore / untimed (not timed)
        self._wanted_plain = False  # the last plan wanted plain decoding and ran it (not a probe)
        self._plain_streak = 0  # one-sequence plans in a row that wanted plain decoding (planned())
        self._reuse: tuple[int, int] | None = None  # (batch-size bucket, steps left) that reuse a plain plan
        self._planned_seqs = 0  # sequences of the last plan
        # The last plan's rates (tokens a second) for the debug log: plain's, and the best speculative
        # option's (its k, raw and calibrated); None where the model did not choose.
        self.rates: tuple | None = None

    def grant_exploration(self, seconds: float) -> None:
        """Set every drafter's exploration budget (tests: a controller starts with none)."""
        self.explore_credit = defaultdict(lambda: seconds)

    def drafter(self, name: str | None = None) -> DrafterStats:
        d = self.drafters.get(name)
        if d is None:  # not setdefault: that builds a DrafterStats on every call, and plan() calls this often
            d = self.drafters[name] = DrafterStats()
        return d

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
        self._explore_names = names
        self._wanted_plain, self._planned_seqs = False, len(seqs)
        self._predicted_accepted, self._accepted = 0.0, 0
        self._sampled_step = any(self.sampled.get(sid, False) for sid, _, _ in seqs)
        self.pinned = pinned or {}
        self.offered, self.offer_sources = offered or {}, offer_sources or {}
        self._ranked_by, self._curves = {}, {}
        fixed = [min(o, cap) if o is not None else None for _, cap, o in seqs]
        self.rates = None
        if not self.adaptive or self.verify_cost.n < MIN_SAMPLES:
            self.step_mode = "untimed"  # calibration learns nothing from steps the model did not choose
            self._book(seqs, 0.0)  # not priced: the warm-up's steps, or no controller at all
            return [(f if f is not None else min(self.max_k, cap),
                     self.pinned.get(sid) or self.current.get(sid, names[0]))
                    for f, (sid, cap, _) in zip(fixed, seqs)]
        if all(f is not None for f in fixed):  # every request set its own k: nothing to choose
            choice, _, self._predicted, _ = self._rate(seqs, fixed, 0, names[:1], base_tokens)
            self.step_mode = "untimed" if any(fixed) else "plain"
            self._book(seqs, 0.0)  # the requests' own choice, not the controller's
            return choice
        n = len(seqs)
        scale = {k > 0: self.calibration.scale(n, "spec" if k else "plain") for k in (0, 1)}
        extra = self.calibration.extra_scale(n, self._sampled_step)  # accepted drafts realized over predicted
        best, best_rate, raw_best, plain, plain_rate = None, -1.0, None, None, 0.0
        spec_best = (0, 0.0, 0.0)  # the best speculative option: (k, raw rate, calibrated rate)
        # Where every drafter's draft is made before the plan (in-process indexes only), a draft is
        # taken whole whatever the step's k: k = 1 is every k > 0 (the other 7 of 9 options cost
        # most of a plan at batch 32).
        k_matters = any(name not in self.offered.get(sid, {}) for sid, cap, _ in seqs if cap > 0 for name in names)
        # One sequence drafts with one drafter: a subset of several prices what its best single one
        # does; and a subset whose every drafter offered its draft prices every k > 0 alike. Left out,
        # a plan at batch 1 with the default stack's two drafters took 0.30 ms, ~2% of a step.
        subsets = _subsets(names) if n > 1 else [[name] for name in names]
        offered_by_all = {name for name in names
                          if all(name in self.offered.get(sid, {}) for sid, cap, _ in seqs if cap > 0)}
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
        wanted = "spec" if best[0] else "plain"
        self.rates = (plain[1] / plain[2] if plain[2] > 0 else 0.0, plain_rate, *spec_best)
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
        self._explored = None
        if self._explore(choice, fixed, seqs, base_tokens, names, expected / max(self._predicted, 1e-9),
                         plain_s, max(step_s - plain_s, 0.0)):
            step_s += self._explored[1]
            self._explored = (*self._explored, self.step_mode)  # and the mode of the step it joined
            self.step_mode = "explore"
        self._book(seqs, step_s / plain_s - 1.0 if self.step_mode != "untimed" and plain_s > 0 else 0.0)
        return choice

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
        return all(name in self.offered.get(sid, {}) for (k, name), (sid, _, _) in zip(choice, seqs) if k > 0)

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
        self.pinned, self.offered, self.offer_sources, self._explored = {}, {}, {}, None
        self._predicted_accepted, self._accepted = 0.0, 0
        self._predicted = self.verify_cost(base_tokens)
        self.step_mode = "plain"
        return [(0, self.current.get(sid)) for sid, _, _ in seqs]

    def offers_may_pay(self, name: str | None, num_seqs: int, base_tokens: int, cap: int,
                       kinds: set[bool]) -> tuple[bool, frozenset[str]]:
        """Whether a draft of some length up to cap that this in-process drafter offers could pay for
        its rows in a step of num_seqs sequences: its accepted tokens (the drafter's positions for
        that length) at the step's rate against the rows' cost, as plan() drops an offer. Where no
        length can, asking the index for every sequence is time lost (at batch 32 on a 2-core EPYC,
        asking and building each sequence's trie on first contact took 5.4% of the steps). -> (that,
        the sources of the index measured so far none of whose drafts could: not worth asking)."""
        if not self.adaptive or self.verify_cost.n < MIN_SAMPLES:
            return True, frozenset()
        # Calibrated as plan() rates its options: the times by what cycles of each mode took over what
        # was predicted, the accepted tokens by what speculative cycles made over their prediction (at
        # T 0.7, batch 8, a datastore's one-hot drafts made half what was predicted, and asked for on
        # that prediction cost 9% in one process). Read once: this runs every step.
        d, extra = self.drafter(name), self.calibration.extra_scale(num_seqs, True in kinds)
        spec_scale = self.calibration.scale(num_seqs, "spec")
        plain_s = self.verify_cost(base_tokens) / self.calibration.scale(num_seqs, "plain")
        step_s = [self.verify_cost(base_tokens + length) / spec_scale for length in range(cap + 1)]

        def may_pay(source: str, sampled: bool, length: int) -> bool:
            positions = d.by_length[sampled].get((source, length)) or Positions()
            accepted = extra * positions.chain(length, self._alpha_prior_of(d, sampled), d.positions[sampled])[length]
            return accepted * step_s[length] >= num_seqs * (step_s[length] - plain_s)

        sources = {s for kind in kinds for s, _ in d.by_length[kind]} | {""}
        paying = {s for s in sources if any(may_pay(s, sampled, length) for sampled in kinds for length in range(1, cap + 1))}
        return bool(paying), frozenset(s for s in sources - paying if s)

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
            name, gain, made, rows = self._best_drafter(sid, ki, subset, whole)
            if name in self.offered.get(sid, {}):  # drafted already: nothing to wait for, an empty draft is plain
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

    def _best_drafter(self, sid: int, k: int, subset: list[str | None],
                      whole: int | None = None) -> tuple[str | None, float, float, float]:
        """The drafter of subset with the most expected accepted tokens for this sequence -> (name,
        accepted, share with drafts, tokens a draft holds); a drafter other than its current one counts its tokens
        DRAFTER_MARGIN lower (also where the subset leaves the current one out). whole: where a
        draft made before the plan is cut (default k)."""
        ranked = self._ranked(sid, k, k if whole is None else whole)
        for score, name, made, rows in ranked:
            if name in subset or sid in self.pinned:
                return name, score, made, rows
        raise ValueError(f"no drafter of {subset} for sequence {sid}")

    def _ranked(self, sid: int, k: int, whole: int) -> list[tuple[float, str | None, float, float]]:
        """(score, drafter, share with drafts, tokens a draft holds) of every drafter this sequence may use, best first
        (on a tie, in the order of the plan's drafters), computed once per plan and k: plan()
        weighs every k and subset of drafters for every sequence, and rereading the estimates
        each time made a plan at batch 32 cost 2.2 ms, 1.35 ms with this (min of 7, 2-core EPYC)."""
        ranked = self._ranked_by.get((sid, k))
        if ranked is None:
            current, offered = self.current.get(sid), self.offered.get(sid, {})
            ranked = []
            for name in [self.pinned[sid]] if sid in self.pinned else self._explore_names:
                alpha, made = self.estimates(sid, name)
                if name in offered:  # its draft is made: known rows, and it holds the history already
                    made = float(offered[name] > 0)
                    accepted, rows = self._offered_curve(sid, name, whole, offered[name])
                    ranked.append((made * accepted, name, made, rows))
                    continue
                accepted, rows = self._curve(sid, name, alpha, k)
                gain = made * accepted
                ranked.append((gain if current is None or name == current else gain / DRAFTER_MARGIN, name, made, rows))
            ranked.sort(key=lambda r: -r[0])  # stable: ties keep the drafters' order
            self._ranked_by[sid, k] = ranked
        return ranked

    def estimates(self, sid: int, name: str | None) -> tuple[float, float]:
        """(acceptance per token, share of proposals with drafts) of this sequence with this drafter:
        its own history, drawn towards the drafter's over all sequences."""
        d = self.drafter(name)
        alpha_prior = self._alpha_prior(sid, d)
        made_prior = d.made.alpha(1.0)
        mine = self.per_seq.get(sid, {}).get(name)
        if mine is None:
            return alpha_prior, made_prior
        return mine.acceptance.alpha(alpha_prior), mine.made.alpha(made_prior)

    def _alpha_prior(self, sid: int, d: DrafterStats) -> float:
        """The drafter's α over all sequences of this one's kind. A sampled sequence's prior starts
        from what greedy ones accepted, not from PRIOR_ALPHA: a draft is accepted less often under
        sampling, and a sampled batch that started from 0.6 speculated on 3,540 draft-model steps
        at batch 32 (0.60x of plain) before it learned."""
        return self._alpha_prior_of(d, self.sampled.get(sid, False))

    @staticmethod
    def _alpha_prior_of(d: DrafterStats, sampled: bool) -> float:
        greedy = d.acceptance[False].alpha(PRIOR_ALPHA)
        return d.acceptance[True].alpha(greedy) if sampled else greedy

    def _curve(self, sid: int, name: str | None, alpha: float, k: int) -> tuple[float, float]:
        """(accepted tokens, tokens drafted) expected of this sequence's draft capped at k: the
        drafter's positions, the accepted ones scaled by how this sequence's α (alpha) compares
        with the drafter's (with no position measured: exactly the geometric E(α, k) - 1)."""
        sampled = self.sampled.get(sid, False)
        curve = self._curves.get((name, sampled))
        if curve is None or len(curve) <= k:  # once per plan: the same for every sequence of the kind
            d = self.drafter(name)
            prior = self._alpha_prior(sid, d)
            curve = self._curves[name, sampled] = [
                (accepted / geometric if (geometric := expected_tokens(prior, j) - 1.0) > 1e-9 else None, rows)
                for j, (accepted, rows) in enumerate(d.positions[sampled].curve(max(k, self.max_k), prior))]
        per_geometric, rows = curve[k]
        if per_geometric is None:
            return 0.0, rows
        return min(per_geometric * (expected_tokens(alpha, k) - 1.0), rows), rows

    def _offered_curve(self, sid: int, name: str | None, k: int, length: int) -> tuple[float, float]:
        """(accepted tokens, tokens drafted) expected of a draft of `length` tokens already offered,
        cut at k: what the drafter's drafts of that length from that source accepted (over all
        sequences of the kind). Not scaled by the sequence's own α, as a drafter asked after the plan
        is (_curve): the offer's source and length already say whether it copies, and the sequence's
        α, read from the short drafts of prose, priced its next offers below what they made (chat at
        batch 1 in one process, a 2-core Xeon without AMX: the one-token offers the plan dropped made
        0.2 tokens each, as the ones it took; unscaled, 1.33-1.35x of plain decoding against
        1.29-1.30x, modeled by one verify-cost table; code edits and summaries alike)."""
        cut = min(k, length)
        if cut <= 0:
            return 0.0, 0.0
        sampled = self.sampled.get(sid, False)
        source = self.offer_sources.get(sid, {}).get(name, "")
        chain = self._curves.get((name, sampled, source, length))
        if chain is None:
            d = self.drafter(name)
            positions = d.by_length[sampled].get((source, length)) or Positions()
            chain = self._curves[name, sampled, source, length] = positions.chain(
                length, self._alpha_prior(sid, d), d.positions[sampled])
        return min(chain[cut], float(cut)), float(cut)

    def _explore(self, choice: list, fixed: list, seqs: list, base_tokens: int, names: list, rate: float,
                 plain_s: float, spent_s: float) -> bool:
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
        if accepted). -> whether one does."""
        idle = [i for i, ((k, _), f) in enumerate(zip(choice, fixed)) if k == 0 and f is None and seqs[i][1] > 0]
        if not idle:
            self.explore_credit.clear()  # nothing to learn: no saving up for a burst
            return False
        i = next((j for j in idle if seqs[j][0] == self.explore_seq), idle[0])
        sid = seqs[i][0]
        tried = self.per_seq.get(sid, {})
        tokens = base_tokens + sum(c[0] for c in choice)

        cap, offered = min(self.max_k, seqs[i][1]), self.offered.get(sid, {})
        options = {n: self._explore_option(n, tokens, cap, offered.get(n))
                   for n in ([self.pinned[sid]] if sid in self.pinned else names) if offered.get(n, 1) > 0}
        affordable = [n for n, (cost, k) in options.items() if self.explore_credit[n] >= cost and k > rate * cost]
        if affordable:  # the ledgers are read only where a try is otherwise made (not every plan's work)
            room_s = min(self.ledger.headroom(s) for s, _, _ in seqs) * plain_s - spent_s
            affordable = [n for n in affordable if options[n][0] <= room_s]
        if affordable:
            name = min(affordable, key=lambda n: (1 + (tried[n].tries if n in tried else 0)) * options[n][0])
            cost, k = options[name]
            self.explore_credit[name] = min(self.explore_credit[name] - cost, cost)
            self._explored = (name, cost)
            self.explore_seq = sid
            choice[i] = (k, name)
            return True
        return False

    def _explore_option(self, name: str | None, tokens: int, cap: int, offered: int | None = None) -> tuple[float, int]:
        """(seconds a try adds to the step, its k) with this drafter: the k of the best step rate
        were its acceptance the prior's (a draft offered already: all of it, its rows the only cost)."""
        if offered is not None:
            k = min(cap, offered)
            return self.verify_cost(tokens + k) - self.verify_cost(tokens), k

        def step_s(k: int) -> float:
            return self.drafter(name).seconds(1, k) + self.verify_cost(tokens + k)

        k = max(range(1, cap + 1), key=lambda k: expected_tokens(PRIOR_ALPHA, k) / max(step_s(k), 1e-9))
        return step_s(k) - self.verify_cost(tokens), k

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
            self.explore_credit[name] -= max(0.0, (now - start) - predicted * ratio - charged)

    def observe_verify(self, tokens: int, seconds: float) -> None:
        self.verify_cost.observe(tokens, seconds)
        for name in self._explore_names:
            self.explore_credit[name] += EXPLORE_SHARE * seconds / len(self._explore_names)

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


def _subsets(names: list) -> list[list]:
    """Every non-empty subset of names, in order (a pool holds a few drafters; beyond 4, the
    single drafters and all of them)."""
    if len(names) > 4:
        return [[n] for n in names] + [names]
    return [[n for j, n in enumerate(names) if mask >> j & 1] for mask in range(1, 1 << len(names))]
