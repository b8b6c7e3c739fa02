"""Speculation controller: how many drafts (k) each sequence gets this step.

Cost model (DESIGN §8), measured online:
  verify time  V(T) = a + b·T, T = tokens in the forward (least squares, forgetting old steps)
  draft time   D(n) = c + e·n per draft step, n = sequences drafting (proposers draft all
               sequences of a step together, so one exploring sequence costs far less
               than the whole batch: a single per-step number made batch 32 look cheap)
  acceptance   α per sequence (geometric MLE: accepted / (accepted + rejections))
  pipelining   a pipelined drafter answers a share h of proposals from its draft cache: it
               drafted them while the previous step verified, so a hit costs the wait W
               (the round trip, plus whatever drafting ahead outlasted the verify: a hit's
               step takes max(verify, draft)); only misses cost D(n)·k. h and W are measured.
Expected tokens from k drafts: E(k) = (1 − α^{k+1}) / (1 − α). The controller picks the
k that maximises Σ E / (V(T0 + Σk) + (1 − h)·D(n)·k + h·W); k = 0 (speculation off) wins when the
target is compute-bound (large batch) or acceptance is low. Turning speculation on must
beat k = 0 by SWITCH_MARGIN: what the model leaves out (the drafter catching up on a
sequence's history when speculation turns on, ragged finishing of a batch) all costs
speculation, so a predicted gain of a few percent is a loss in practice.
"""
from __future__ import annotations

from dataclasses import dataclass

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


class SpecController:
    def __init__(self, max_k: int, adaptive: bool = True):
        self.max_k, self.adaptive = max_k, adaptive
        self.verify_cost = LinearCost()
        self.draft_cost = LinearCost(decay=0.9)  # seconds per draft step vs sequences drafting
        self.hit_rate = 0.0  # pipelined drafters: share of proposals from the draft cache (EWMA)
        self.hit_wait = 0.0  # seconds a propose call waits when its proposals were drafted ahead (EWMA)
        self.global_acceptance = _Acceptance()
        self.per_seq: dict[int, _Acceptance] = {}
        self.explore_credit = 0.0  # seconds of verify time not yet spent on exploring
        self.explore_seq: int | None = None  # the sequence that explores while it runs

    def choose(self, seqs: list[tuple[int, int, int | None]], base_tokens: int) -> list[int]:
        """seqs: (seq_id, cap, override) per decoding sequence → k per sequence.

        cap bounds k by max_tokens / max_model_len / KV room; override is the request's
        own num_speculative_tokens (None: ours to choose; 0: off).
        """
        fixed = [min(o, cap) if o is not None else None for _, cap, o in seqs]
        if not self.adaptive or self.verify_cost.n < MIN_SAMPLES:
            return [f if f is not None else min(self.max_k, cap) for f, (_, cap, _) in zip(fixed, seqs)]
        prior = self.global_acceptance.alpha(PRIOR_ALPHA)
        alphas = [self.per_seq.get(sid, _Acceptance()).alpha(prior) for sid, _, _ in seqs]
        best_k, best_rate = 0, -1.0
        for k in range(self.max_k + 1):
            ks = [f if f is not None else min(k, cap) for f, (_, cap, _) in zip(fixed, seqs)]
            tokens = sum(expected_tokens(a, ki) for a, ki in zip(alphas, ks))
            drafting = sum(1 for ki in ks if ki > 0)
            seconds = self.verify_cost(base_tokens + sum(ks)) + self.draft_seconds(drafting, max(ks, default=0))
            rate = tokens / seconds if seconds > 0 else tokens
            # Turning speculation on must clearly pay; among k > 0 prefer the smaller when close.
            if rate > best_rate * (SWITCH_MARGIN if best_k == 0 else 1.01):
                best_k, best_rate = k, rate
        ks = [f if f is not None else min(best_k, cap) for f, (_, cap, _) in zip(fixed, seqs)]
        self._explore(ks, fixed, seqs, base_tokens)
        return ks

    def _explore(self, ks: list[int], fixed: list, seqs: list, base_tokens: int) -> None:
        """Let one sequence that is not speculating draft at full k, when the budget allows."""
        idle = [i for i, (k, f) in enumerate(zip(ks, fixed)) if k == 0 and f is None and seqs[i][1] > 0]
        if not idle:
            self.explore_credit = 0.0  # nothing to learn: do not save up for a burst later
            return
        i = next((j for j in idle if seqs[j][0] == self.explore_seq), idle[0])
        k = min(self.max_k, seqs[i][1])
        tokens = base_tokens + sum(ks)
        cost = self.draft_seconds(1, k) + self.verify_cost(tokens + k) - self.verify_cost(tokens)
        if self.explore_credit >= cost:
            self.explore_credit = min(self.explore_credit - cost, cost)
            self.explore_seq = seqs[i][0]
            ks[i] = k

    def observe_verify(self, tokens: int, seconds: float) -> None:
        self.verify_cost.observe(tokens, seconds)
        self.explore_credit += EXPLORE_SHARE * seconds

    def draft_seconds(self, num_seqs: int, k: int) -> float:
        """Expected wait for drafts: k draft steps over num_seqs sequences, less what was drafted ahead."""
        if k <= 0:
            return 0.0
        return (1 - self.hit_rate) * self.draft_cost(num_seqs) * k + self.hit_rate * self.hit_wait

    def observe_draft(self, steps: int, num_seqs: int, seconds: float, cached: float = 0.0) -> None:
        """A propose call: `steps` draft steps (the largest k) over `num_seqs` sequences, a share
        `cached` of them answered from a pipelined drafter's draft cache."""
        if steps <= 0 or num_seqs <= 0:
            return
        self.hit_rate = 0.9 * self.hit_rate + 0.1 * cached
        if cached >= 1.0:
            self.hit_wait = seconds if self.hit_wait == 0.0 else 0.9 * self.hit_wait + 0.1 * seconds
        elif cached == 0.0:
            self.draft_cost.observe(num_seqs, seconds / steps)

    def observe_accept(self, seq_id: int, num_draft: int, num_accepted: int) -> None:
        if num_draft == 0:
            return
        trials = num_accepted + (1 if num_accepted < num_draft else 0)
        for acc in (self.per_seq.setdefault(seq_id, _Acceptance()), self.global_acceptance):
            acc.accepted = 0.95 * acc.accepted + num_accepted
            acc.trials = 0.95 * acc.trials + trials

    def release(self, seq_id: int) -> None:
        self.per_seq.pop(seq_id, None)
