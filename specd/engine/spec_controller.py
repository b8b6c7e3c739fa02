"""Speculation controller: how many drafts (k) each sequence gets this step, and from which
drafter where several serve (a verifier's pool: e.g. a draft model and a suffix index).

Cost model (DESIGN §8), measured online:
  verify time  V(T), T = tokens in the forward: measured per T up to VerifyCost.TABLE_MAX (a
               CPU's matmul computes rows in register tiles, so e.g. 1-4 rows cost alike and a
               5th costs a tile more: a line through the points misprices every k), a + b·T
               beyond (least squares, forgetting old steps)
  draft time   D(n) = c + e·n per draft step, n = sequences drafting (proposers draft all
               sequences of a step together, so one exploring sequence costs far less
               than the whole batch: a single per-step number made batch 32 look cheap)
  acceptance   α per sequence (geometric MLE: accepted / (accepted + rejections))
  pipelining   a pipelined drafter answers a share h of proposals from its draft cache: it
               drafted them while the previous step verified, so a hit costs the wait W
               (the round trip, plus whatever drafting ahead outlasted the verify: a hit's
               step takes max(verify, draft)); only misses cost D(n)·k. h and W are measured.
  drafters  D, h, W and α are kept per drafter (α also per sequence and drafter), with y, the
               share of proposals that held drafts (a suffix index drafts only where the text
               repeats; a proposal without drafts costs its round trip and nothing else).
Expected tokens from k drafts: E(k) = 1 + y·((1 − α^{k+1}) / (1 − α) − 1). The controller
picks the k, and per sequence the drafter out of a set S of drafters drafting this step
(every subset is tried), that maximise Σ E / (V(T0 + Σ y·k) + max over S of the drafter's
(1 − h)·D(n)·k + h·W) (drafters of one step answer concurrently); k = 0 (speculation off)
wins when the target is compute-bound (large batch) or acceptance is low. A sequence changes
drafter only for a clearly better one (DRAFTER_MARGIN): the new drafter reads its whole
history first. Turning speculation on must
beat k = 0 by SWITCH_MARGIN: what the model leaves out (the drafter catching up on a
sequence's history when speculation turns on, ragged finishing of a batch) all costs
speculation, so a predicted gain of a few percent is a loss in practice.
"""
from __future__ import annotations

from dataclasses import dataclass, field

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
DRAFTER_MARGIN = 1.10


class LinearCost:
    """Exponentially weighted least squares fit of seconds = a + b * tokens."""

    def __init__(self, decay: float = 0.98):
        self.decay, self.n = decay, 0
        self.s1 = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        g = self.decay
        self.s1, self.sx, self.sy = g * self.s1 + 1, g * self.sx + tokens, g * self.sy + seconds
        self.sxx, self.sxy = g * self.sxx + tokens * tokens, g * self.sxy + tokens * seconds
        self.n += 1

    def __call__(self, tokens: int) -> float:
        if self.s1 == 0:
            return 0.0
        mean_x, mean_y = self.sx / self.s1, self.sy / self.s1
        var = self.sxx / self.s1 - mean_x**2
        slope = max((self.sxy / self.s1 - mean_x * mean_y) / var, 0.0) if var > 1e-9 else 0.0
        return max(mean_y + slope * (tokens - mean_x), 0.0)


class VerifyCost:
    """Seconds of a verify forward by its token count T: the median of the last few steps of
    each T up to TABLE_MAX, the line (LinearCost) beyond. A small T not measured yet is priced
    at the dearest smaller T measured, the least it can cost (a forward never gets cheaper with
    more tokens), so the controller tries it once and then knows its price (a k that fills a
    tile for free is found, not assumed away by the line)."""

    TABLE_MAX = 16
    KEEP = 5

    def __init__(self) -> None:
        self.line = LinearCost()
        self.table: dict[int, list[float]] = {}

    @property
    def n(self) -> int:
        return self.line.n

    def observe(self, tokens: int, seconds: float) -> None:
        self.line.observe(tokens, seconds)
        if tokens <= self.TABLE_MAX:
            recent = self.table.setdefault(tokens, [])
            recent.append(seconds)
            del recent[:-self.KEEP]

    def measured(self, tokens: int) -> float | None:
        recent = self.table.get(tokens)
        return sorted(recent)[len(recent) // 2] if recent else None

    def __call__(self, tokens: int) -> float:
        if tokens > self.TABLE_MAX:
            return self.line(tokens)
        here = self.measured(tokens)
        if here is not None:
            return here
        below = [self.measured(t) for t in self.table if t < tokens]
        return min(max(below), self.line(tokens)) if below else self.line(tokens)


def expected_tokens(alpha: float, k: int) -> float:
    if k == 0:
        return 1.0
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


@dataclass
class _Acceptance:
    accepted: float = 0.0
    trials: float = 0.0

    def alpha(self, prior: float) -> float:
        # Two pseudo-trials of the prior keep a short history from swinging to 0 or 1.
        return (self.accepted + 2 * prior) / (self.trials + 2)

    def observe(self, accepted: float, trials: float) -> None:
        self.accepted = 0.95 * self.accepted + accepted
        self.trials = 0.95 * self.trials + trials


@dataclass
class _Drafter:
    """What the controller knows of one drafter: its cost, and its acceptance over all sequences."""

    cost: LinearCost = field(default_factory=lambda: LinearCost(decay=0.9))  # s per draft step vs seqs
    hit_rate: float = 0.0  # pipelined drafters: share of proposals from the draft cache (EWMA)
    hit_wait: float = 0.0  # seconds a propose call waits when its proposals were drafted ahead (EWMA)
    acceptance: _Acceptance = field(default_factory=_Acceptance)
    made: _Acceptance = field(default_factory=_Acceptance)  # proposals with drafts / proposals

    def seconds(self, num_seqs: int, k: int) -> float:
        """Expected wait for drafts: k draft steps over num_seqs sequences, less what was drafted ahead."""
        if k <= 0:
            return 0.0
        return (1 - self.hit_rate) * self.cost(num_seqs) * k + self.hit_rate * self.hit_wait


@dataclass
class _SeqDrafter:
    acceptance: _Acceptance = field(default_factory=_Acceptance)
    made: _Acceptance = field(default_factory=_Acceptance)


class _Rate:
    """Exponentially weighted tokens per second of one kind of step cycle (recent cycles count most:
    a probe of a few cycles is enough to change the verdict)."""

    def __init__(self) -> None:
        self.tokens = self.seconds = 0.0
        self.n = 0

    def observe(self, tokens: int, seconds: float) -> None:
        self.tokens, self.seconds, self.n = 0.7 * self.tokens + tokens, 0.7 * self.seconds + seconds, self.n + 1

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class RealizedGuard:
    """Never slower, whatever the cost model believes: per decoding batch size (in powers of two),
    the tokens per second that decode cycles really gave (from one step's start to the next's,
    so the service's own work per step counts) with speculation and without. Speculation goes on
    only while it has been at least as fast as plain decoding; every PROBE_EVERY cycles the side
    not in use runs PROBE_CYCLES cycles so both stay fresh (about 6% of cycles off the best)."""

    PROBE_EVERY = 64
    PROBE_CYCLES = 4

    def __init__(self) -> None:
        self.rates: dict[tuple[int, str], _Rate] = {}
        self.since_probe: dict[int, int] = {}
        self.probing: dict[int, int] = {}  # cycles of the current probe left

    @staticmethod
    def bucket(num_seqs: int) -> int:
        return 1 << max(0, num_seqs - 1).bit_length()

    def rate(self, num_seqs: int, mode: str) -> _Rate:
        return self.rates.setdefault((self.bucket(num_seqs), mode), _Rate())

    def allows(self, num_seqs: int) -> bool:
        """Whether a step the cost model wants speculative may speculate."""
        b = self.bucket(num_seqs)
        plain, spec = self.rate(num_seqs, "plain"), self.rate(num_seqs, "spec")
        if spec.n < self.PROBE_CYCLES:
            return True  # first measure what the model wants
        if plain.n < self.PROBE_CYCLES:
            return False  # then what it would leave
        winning = spec.rate >= plain.rate
        if self.probing.get(b):
            self.probing[b] -= 1
            return not winning
        self.since_probe[b] = self.since_probe.get(b, 0) + 1
        if self.since_probe[b] >= self.PROBE_EVERY:
            self.since_probe[b], self.probing[b] = 0, self.PROBE_CYCLES - 1
            return not winning
        return winning

    def observe(self, num_seqs: int, mode: str, tokens: int, seconds: float) -> None:
        if mode in ("plain", "spec") and seconds > 0:
            self.rate(num_seqs, mode).observe(tokens, seconds)


class SpecController:
    def __init__(self, max_k: int, adaptive: bool = True):
        self.max_k, self.adaptive = max_k, adaptive
        self.verify_cost = VerifyCost()
        self.drafters: dict[str | None, _Drafter] = {}  # None: the one proposer of an engine
        self.per_seq: dict[int, dict[str | None, _SeqDrafter]] = {}
        self.current: dict[int, str | None] = {}  # the drafter each sequence drafted with last
        self.explore_credit = 0.0  # seconds of verify time not yet spent on exploring
        self.explore_seq: int | None = None  # the sequence that explores while it runs
        self.pinned: dict[int, str] = {}  # this step's sequences whose request named its drafter
        self.guard = RealizedGuard()
        self._cycle: tuple | None = None
        self.step_mode = "plain"  # this step as the guard sees it: plain, spec, or explore / untimed (not timed)

    def drafter(self, name: str | None = None) -> _Drafter:
        return self.drafters.setdefault(name, _Drafter())

    def choose(self, seqs: list[tuple[int, int, int | None]], base_tokens: int) -> list[int]:
        """k per sequence, where one proposer drafts (plan() with a single drafter)."""
        return [k for k, _ in self.plan(seqs, base_tokens)]

    def plan(self, seqs: list[tuple[int, int, int | None]], base_tokens: int,
             drafters: list[str | None] | None = None,
             pinned: dict[int, str] | None = None) -> list[tuple[int, str | None]]:
        """seqs: (seq_id, cap, override) per decoding sequence → (k, drafter) per sequence.

        cap bounds k by max_tokens / max_model_len / KV room; override is the request's
        own num_speculative_tokens (None: ours to choose; 0: off). drafters: those that may
        draft this step, in the order to prefer on a tie (None: the engine's one proposer);
        pinned: sequences whose request named its drafter.
        """
        names = list(drafters) if drafters else [None]
        self.pinned = pinned or {}
        fixed = [min(o, cap) if o is not None else None for _, cap, o in seqs]
        if not self.adaptive or self.verify_cost.n < MIN_SAMPLES:
            self.step_mode = "untimed"  # the guard learns nothing from steps the model did not choose
            return [(f if f is not None else min(self.max_k, cap),
                     self.pinned.get(sid) or self.current.get(sid, names[0]))
                    for f, (sid, cap, _) in zip(fixed, seqs)]
        best, best_rate = None, -1.0
        for k in range(self.max_k + 1):
            for subset in _subsets(names) if k else [names[:1]]:
                choice, rate = self._rate(seqs, fixed, k, subset, base_tokens)
                # Turning speculation on must clearly pay; among k > 0 prefer the smaller when close.
                if rate > best_rate * (SWITCH_MARGIN if best is None or best[0] == 0 else 1.01):
                    best, best_rate = (k, choice), rate
        choice = best[1]
        if best[0] > 0 and not self.guard.allows(len(seqs)):
            choice = [(f if f is not None else 0, name) for f, (_, name) in zip(fixed, choice)]
        # Requests with their own k are neither plain nor the controller's choice: not timed.
        self.step_mode = ("untimed" if any(fixed) else
                          "spec" if any(k for k, _ in choice) else "plain")
        if self._explore(choice, fixed, seqs, base_tokens, names):
            self.step_mode = "explore"
        return choice

    def _rate(self, seqs, fixed, k: int, subset: list[str | None], base_tokens: int):
        """(k, drafter) per sequence with drafters from subset, and the tokens per second expected."""
        choice, tokens, verify_tokens = [], 0.0, float(base_tokens)
        load: dict[str | None, tuple[int, int]] = {}  # drafter -> (sequences, largest k)
        for f, (sid, cap, _) in zip(fixed, seqs):
            ki = f if f is not None else min(k, cap)
            if ki <= 0:
                choice.append((0, self.current.get(sid, subset[0])))
                tokens += 1.0
                continue
            name, gain, made = self._best_drafter(sid, ki, subset)
            choice.append((ki, name))
            tokens += 1.0 + gain
            verify_tokens += made * ki
            n, most = load.get(name, (0, 0))
            load[name] = (n + 1, max(most, ki))
        drafting = max((self.drafter(d).seconds(n, most) for d, (n, most) in load.items()), default=0.0)
        seconds = self.verify_cost(round(verify_tokens)) + drafting
        return choice, tokens / seconds if seconds > 0 else tokens

    def _best_drafter(self, sid: int, k: int, subset: list[str | None]) -> tuple[str | None, float, float]:
        """The drafter of subset with the most expected accepted tokens for this sequence -> (name,
        accepted, share with drafts); a drafter other than its current one counts its tokens
        DRAFTER_MARGIN lower (also where the subset leaves the current one out)."""
        if sid in self.pinned:
            subset = [self.pinned[sid]]
        current = self.current.get(sid)
        best = None
        for name in subset:
            alpha, made = self.estimates(sid, name)
            gain = made * (expected_tokens(alpha, k) - 1.0)
            score = gain if current is None or name == current else gain / DRAFTER_MARGIN
            if best is None or score > best[0]:
                best = (score, name, made)
        return best[1], best[0], best[2]

    def estimates(self, sid: int, name: str | None) -> tuple[float, float]:
        """(acceptance per token, share of proposals with drafts) of this sequence with this drafter:
        its own history, drawn towards the drafter's over all sequences."""
        d = self.drafter(name)
        alpha_prior, made_prior = d.acceptance.alpha(PRIOR_ALPHA), d.made.alpha(1.0)
        mine = self.per_seq.get(sid, {}).get(name)
        if mine is None:
            return alpha_prior, made_prior
        return mine.acceptance.alpha(alpha_prior), mine.made.alpha(made_prior)

    def _explore(self, choice: list, fixed: list, seqs: list, base_tokens: int, names: list) -> bool:
        """Let one sequence that is not speculating draft at full k, when the budget allows, with
        the drafter it has tried least. -> whether one does."""
        idle = [i for i, ((k, _), f) in enumerate(zip(choice, fixed)) if k == 0 and f is None and seqs[i][1] > 0]
        if not idle:
            self.explore_credit = 0.0  # nothing to learn: do not save up for a burst later
            return False
        i = next((j for j in idle if seqs[j][0] == self.explore_seq), idle[0])
        sid = seqs[i][0]
        tried = self.per_seq.get(sid, {})
        name = self.pinned.get(sid) or min(names, key=lambda n: tried[n].made.trials if n in tried else 0.0)
        k = min(self.max_k, seqs[i][1])
        tokens = base_tokens + sum(c[0] for c in choice)
        cost = self.drafter(name).seconds(1, k) + self.verify_cost(tokens + k) - self.verify_cost(tokens)
        if self.explore_credit >= cost:
            self.explore_credit = min(self.explore_credit - cost, cost)
            self.explore_seq = sid
            choice[i] = (k, name)
            return True
        return False

    def open_cycle(self, num_seqs: int, tokens: int, start: float, compute_s: float) -> None:
        """A decode-only step began at `start`, committed `tokens` for num_seqs sequences and
        computed for compute_s; its cycle ends when the next step begins (close_cycle)."""
        self._cycle = (num_seqs, self.step_mode, tokens, start, compute_s)

    def close_cycle(self, now: float) -> None:
        cycle, self._cycle = self._cycle, None
        if cycle is None:
            return
        num_seqs, mode, tokens, start, compute_s = cycle
        if now - start <= 2 * compute_s + 0.05:  # longer: the engine waited for work, not an overhead
            self.guard.observe(num_seqs, mode, tokens, now - start)

    def observe_verify(self, tokens: int, seconds: float) -> None:
        self.verify_cost.observe(tokens, seconds)
        self.explore_credit += EXPLORE_SHARE * seconds

    def draft_seconds(self, num_seqs: int, k: int, name: str | None = None) -> float:
        return self.drafter(name).seconds(num_seqs, k)

    def observe_draft(self, steps: int, num_seqs: int, seconds: float, cached: float = 0.0,
                      name: str | None = None) -> None:
        """A propose call: `steps` draft steps (the largest k) over `num_seqs` sequences, a share
        `cached` of them answered from a pipelined drafter's draft cache."""
        if steps <= 0 or num_seqs <= 0:
            return
        d = self.drafter(name)
        d.hit_rate = 0.9 * d.hit_rate + 0.1 * cached
        if cached >= 1.0:
            d.hit_wait = seconds if d.hit_wait == 0.0 else 0.9 * d.hit_wait + 0.1 * seconds
        elif cached == 0.0:
            d.cost.observe(num_seqs, seconds / steps)

    def observe_proposal(self, seq_id: int, name: str | None, made: bool) -> None:
        """A sequence asked `name` for drafts and got some (made) or none."""
        self.current[seq_id] = name
        mine = self.per_seq.setdefault(seq_id, {}).setdefault(name, _SeqDrafter())
        for acc in (mine.made, self.drafter(name).made):
            acc.observe(float(made), 1.0)

    def observe_accept(self, seq_id: int, num_draft: int, num_accepted: int, name: str | None = None) -> None:
        if num_draft == 0:
            return
        trials = num_accepted + (1 if num_accepted < num_draft else 0)
        mine = self.per_seq.setdefault(seq_id, {}).setdefault(name, _SeqDrafter())
        for acc in (mine.acceptance, self.drafter(name).acceptance):
            acc.observe(num_accepted, trials)

    def release(self, seq_id: int) -> None:
        self.per_seq.pop(seq_id, None)
        self.current.pop(seq_id, None)


def _subsets(names: list) -> list[list]:
    """Every non-empty subset of names, in order (a pool holds a few drafters; beyond 4, the
    single drafters and all of them)."""
    if len(names) > 4:
        return [[n] for n in names] + [names]
    return [[n for j, n in enumerate(names) if mask >> j & 1] for mask in range(1, 1 << len(names))]
