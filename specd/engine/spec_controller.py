"""Speculation controller: how many drafts (k) each sequence gets this step.

Cost model (DESIGN §8), measured online:
  verify time  V(T) = a + b·T, T = tokens in the forward (least squares, forgetting old steps)
  draft time   d per draft step (proposers draft all sequences of a step together)
  acceptance   α per sequence (geometric MLE: accepted / (accepted + rejections))
Expected tokens from k drafts: E(k) = (1 − α^{k+1}) / (1 − α). The controller picks the
k that maximises Σ E / (V(T0 + Σk) + d·k); k = 0 (speculation off) wins when the
target is compute-bound (large batch) or acceptance is low.
"""
from __future__ import annotations

from dataclasses import dataclass

PRIOR_ALPHA = 0.6  # acceptance assumed for a sequence before it has any history
MIN_SAMPLES = 8  # verify timings needed before the cost model is trusted
EXPLORE_EVERY = 8  # every n-th step one sequence drafts at full k, so α estimates stay fresh


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
        self.draft_step_seconds = 0.0
        self.global_acceptance = _Acceptance()
        self.per_seq: dict[int, _Acceptance] = {}
        self.steps = 0

    def choose(self, seqs: list[tuple[int, int, int | None]], base_tokens: int) -> list[int]:
        """seqs: (seq_id, cap, override) per decoding sequence → k per sequence.

        cap bounds k by max_tokens / max_model_len / KV room; override is the request's
        own num_speculative_tokens (None: ours to choose; 0: off).
        """
        self.steps += 1
        fixed = [min(o, cap) if o is not None else None for _, cap, o in seqs]
        if not self.adaptive or self.verify_cost.n < MIN_SAMPLES:
            return [f if f is not None else min(self.max_k, cap) for f, (_, cap, _) in zip(fixed, seqs)]
        prior = self.global_acceptance.alpha(PRIOR_ALPHA)
        alphas = [self.per_seq.get(sid, _Acceptance()).alpha(prior) for sid, _, _ in seqs]
        best_k, best_rate = 0, -1.0
        for k in range(self.max_k + 1):
            ks = [f if f is not None else min(k, cap) for f, (_, cap, _) in zip(fixed, seqs)]
            tokens = sum(expected_tokens(a, ki) for a, ki in zip(alphas, ks))
            seconds = self.verify_cost(base_tokens + sum(ks)) + self.draft_step_seconds * max(ks, default=0)
            rate = tokens / seconds if seconds > 0 else tokens
            if rate > best_rate * 1.01:  # prefer the smaller k unless the larger one clearly pays
                best_k, best_rate = k, rate
        ks = [f if f is not None else min(best_k, cap) for f, (_, cap, _) in zip(fixed, seqs)]
        if self.steps % EXPLORE_EVERY == 0 and seqs:
            # One sequence in turn drafts at full k, so acceptance estimates stay fresh
            # when speculation is off, at the cost of a few extra tokens in one step.
            i = (self.steps // EXPLORE_EVERY) % len(seqs)
            if fixed[i] is None:
                ks[i] = min(self.max_k, seqs[i][1])
        return ks

    def observe_verify(self, tokens: int, seconds: float) -> None:
        self.verify_cost.observe(tokens, seconds)

    def observe_draft(self, steps: int, seconds: float) -> None:
        if steps > 0:
            per_step = seconds / steps
            self.draft_step_seconds = per_step if self.draft_step_seconds == 0 else (
                0.9 * self.draft_step_seconds + 0.1 * per_step)

    def observe_accept(self, seq_id: int, num_draft: int, num_accepted: int) -> None:
        if num_draft == 0:
            return
        trials = num_accepted + (1 if num_accepted < num_draft else 0)
        for acc in (self.per_seq.setdefault(seq_id, _Acceptance()), self.global_acceptance):
            acc.accepted = 0.95 * acc.accepted + num_accepted
            acc.trials = 0.95 * acc.trials + trials

    def release(self, seq_id: int) -> None:
        self.per_seq.pop(seq_id, None)
