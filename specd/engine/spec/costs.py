"""What speculative steps cost, measured online (the speculation controller's inputs): verify
time by tokens in the forward (VerifyCost), a drafter's time per draft step by batch size
(DraftCost), and how long decode cycles really took, and how many drafts their speculative ones
had accepted, against what the controller predicted (RealizedCalibration: its never-slower rule)."""
from __future__ import annotations


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


class _Recent:
    """The last KEEP observations of one cost, read as their median (a one-off, e.g. a drafter
    reading a whole history on first contact, moves it not at all)."""

    KEEP = 5

    def __init__(self) -> None:
        self.values: list[float] = []
        self._median = 0.0

    def observe(self, seconds: float) -> None:
        self.values.append(seconds)
        del self.values[:-self.KEEP]
        # kept here: the controller reads a cost many times a step and observes it once
        self._median = sorted(self.values)[len(self.values) // 2]

    def median(self) -> float:
        return self._median


class DraftCost:
    """Seconds per draft step by the number of sequences drafted for: per batch size (in powers of
    two, as RealizedCalibration buckets them) the median of that size's recent calls, and for a
    size not seen yet the line through all calls. The line alone kept a drafter's round trip under
    32 streams for the batch-1 requests after them: with every recent call at 32 sequences the
    line is flat, nothing at batch 1 drafted to correct it, and exploring there was priced as
    dear as at 32."""

    def __init__(self) -> None:
        self.line = LinearCost(decay=0.9)
        self.by_bucket: dict[int, _Recent] = {}

    def observe(self, num_seqs: int, seconds: float) -> None:
        self.line.observe(num_seqs, seconds)
        self.by_bucket.setdefault(RealizedCalibration.bucket(num_seqs), _Recent()).observe(seconds)

    def __call__(self, num_seqs: int) -> float:
        own = self.by_bucket.get(RealizedCalibration.bucket(num_seqs))
        return own.median() if own is not None else self.line(num_seqs)


class VerifyCost:
    """Seconds of a verify forward by its token count T: the median of the last few steps of
    each T up to TABLE_MAX, the line (LinearCost) beyond. A small T not measured yet is priced
    at the dearest smaller T measured, the least it can cost (a forward never gets cheaper with
    more tokens), so the controller tries it once and then knows its price (a k that fills a
    tile for free is found, not assumed away by the line)."""

    TABLE_MAX = 16

    def __init__(self) -> None:
        self.line = LinearCost()
        self.table: dict[int, _Recent] = {}

    @property
    def n(self) -> int:
        return self.line.n

    def observe(self, tokens: int, seconds: float) -> None:
        self.line.observe(tokens, seconds)
        if tokens <= self.TABLE_MAX:
            self.table.setdefault(tokens, _Recent()).observe(seconds)

    def measured(self, tokens: int) -> float | None:
        recent = self.table.get(tokens)
        return recent.median() if recent is not None else None

    def __call__(self, tokens: float) -> float:
        """Fractional counts (drafters that draft for a share of proposals) interpolate between
        the whole counts around them: rounding 1 + 0.87 * 4 down to 4 tokens priced a 5-token
        forward as a 4-token one."""
        low = int(tokens)
        if tokens > low:
            return self._whole(low) + (tokens - low) * (self._whole(low + 1) - self._whole(low))
        return self._whole(low)

    def _whole(self, tokens: int) -> float:
        if tokens > self.TABLE_MAX:
            return self.line(tokens)
        here = self.measured(tokens)
        if here is not None:
            return here
        below = [self.measured(t) for t in self.table if t < tokens]
        return min(max(below), self.line(tokens)) if below else self.line(tokens)


class _Ratio:
    """Realized over predicted, as decayed sums (recent cycles count most), over n cycles. The
    first cycle comes with PRIOR cycles of 'as predicted', so one unlucky cycle cannot condemn a mode."""

    PRIOR = 4

    def __init__(self) -> None:
        self.real = self.predicted = 0.0
        self.n = 0

    def observe(self, real: float, predicted: float, decay: float) -> None:
        if self.predicted == 0.0:
            self.real = self.predicted = self.PRIOR * predicted
        self.real, self.predicted = decay * self.real + real, decay * self.predicted + predicted
        self.n += 1

    @property
    def value(self) -> float:
        return self.real / self.predicted if self.predicted > 0 else 1.0


class RealizedCalibration:
    """Never slower, whatever the cost model believes: per decoding batch size (in powers of two)
    and mode (plain or spec), how long decode cycles really took over what the model predicted
    for them, from one step's start to the next, so the drafter's round trip, the cores it takes
    from the verifier and the service's own work per step all count. The controller divides each
    option's predicted time by its mode's ratio before it picks, so speculation that ran slower
    than plain decoding stops being picked. And per batch size, the drafts speculative cycles had
    accepted over those predicted (extra_scale), by which the controller scales a speculative
    option's drafted tokens: the steps it picks are those whose estimates came out high. Tokens
    follow the text (a passage that stops repeating), which the acceptance estimates follow per
    sequence, so this ratio is kept to the bias of the choice: over the chosen steps, against
    their own predictions, forgotten as fast as the times (DECAY), and measured again on every
    probe of speculation. Kept apart for steps where a sampled sequence decodes and steps where all
    are greedy: the acceptance model's bias differs by kind (at batch 8 on chat, greedy steps accepted
    1.33x what was predicted, and scaled by that, sampled ones were picked where they accepted far
    less: 0.94x of plain, 2-core Xeon, 2026-11-29). The side not in use is probed (PROBE_CYCLES
    cycles after PROBE_AFTER of the other) so both stay measured, and a probe's cycles outweigh the
    history before them (a probe refreshes)."""

    DECAY = 0.9
    # Cycles of the mode in use before the other is probed: speculation every 64 plain cycles (it
    # may have come to pay), plain decoding every 256 speculative ones (its cost moves little).
    PROBE_AFTER = {"plain": 64, "spec": 256}
    PROBE_CYCLES = 4
    # A probe of a mode last measured slower loses what it was measured to lose: probes come no
    # more often than keeps that under this share of the time (every 64 cycles, a probe whose
    # cycles each cost 2 plain ones lost 6%), but at least every PROBE_MAX cycles (a mode that
    # comes to pay is found within that).
    PROBE_SHARE = 0.02
    PROBE_MAX = 1024

    def __init__(self) -> None:
        self.cal: dict[tuple[int, str], _Ratio] = {}  # (batch bucket, mode) -> cycle seconds ratio
        # (batch bucket, any sequence sampled) -> accepted drafts over those predicted, spec cycles
        self.extra: dict[tuple[int, bool], _Ratio] = {}
        self.since_probe: dict[int, int] = {}
        self.probing: dict[int, tuple[str, int]] = {}  # bucket -> (mode probed, cycles left)

    @staticmethod
    def bucket(num_seqs: int) -> int:
        return 1 << max(0, num_seqs - 1).bit_length()

    def get(self, num_seqs: int, mode: str) -> _Ratio:
        return self.cal.setdefault((self.bucket(num_seqs), mode), _Ratio())

    def scale(self, num_seqs: int, mode: str) -> float:
        """Predicted over realized time for this mode (1 until it has been measured)."""
        c = self.get(num_seqs, mode)
        return 1.0 / c.value if c.n else 1.0

    def extra_scale(self, num_seqs: int, sampled: bool = False) -> float:
        """Accepted drafts over what the controller predicted for the speculative cycles it chose at
        this batch size, of this kind (sampled: a sequence of the step samples; 1 until measured). The acceptance estimates are unbiased each, but the
        steps chosen are those whose estimates came out high (the winner's curse): at T 0.7 on code
        edits, batch 8, the chosen steps had 13.9 tokens predicted and 12.5 made, 8.9 and 7.1 at 5
        sequences, and their cycles, timed as predicted, ran below plain decoding's rate (2-core
        Xeon, 2026-11-28). Time alone could not see it.

        Not for one sequence: there the plan picks among one stream's drafts, read by what drafts of
        their source and length accepted over all sequences, so there is little winner's curse to
        undo, and over the ~10 cycles this ratio remembers, one stream's accepted drafts are noise:
        greedy chat at batch 1 read 0.6 to 1.5 from plan to plan and dropped a fifth of the one-token
        offers, which made as much as the ones taken (2-core Xeon without AMX, 2026-11-29:
        bench/offer_decisions.py, the server's choice 0.95x of fixed k 8 on chat with it, 0.96x and
        0.99x without; code edits alike); one stream at T 0.7 (8 prompts, 128 tokens each, in one
        process, the same Xeon, 2026-11-30): chat 1.06x -> 1.08x of plain, code edits 1.38x -> 1.49x,
        summaries 1.16x -> 1.22x without it (fixed k 8: 1.09x, 1.50x, 1.26x). So it is not kept for
        one (observe)."""
        c = self.extra.get((self.bucket(num_seqs), sampled))
        return min(max(c.value, 0.25), 2.0) if c is not None and c.n else 1.0

    def mode(self, num_seqs: int, wanted: str, spec_may_pay: bool = True, probe_loss: float = 0.0) -> str:
        """The mode to run this cycle: the one the calibrated model wants, or the other on a probe
        (also while the other has never been measured). Speculation is probed only where the
        model before calibration wants it (spec_may_pay): where it predicts a loss anyway, a
        probe would only cost. probe_loss: the cycles of the wanted mode one cycle of the other
        loses, as last measured; probes are spaced so that they lose at most PROBE_SHARE of the
        time, or PROBE_MAX cycles apart."""
        b = self.bucket(num_seqs)
        other = "plain" if wanted == "spec" else "spec"
        if other == "spec" and not spec_may_pay:
            self.probing.pop(b, None)
            return wanted
        if b in self.probing:
            probed, left = self.probing.pop(b)
            if left > 1:
                self.probing[b] = (probed, left - 1)
            return probed
        if self.get(num_seqs, wanted).n < self.PROBE_CYCLES:
            return wanted  # first measure what the model wants, then what it would leave
        self.since_probe[b] = self.since_probe.get(b, 0) + 1
        interval = min(max(self.PROBE_AFTER[wanted], self.PROBE_CYCLES * probe_loss / self.PROBE_SHARE), self.PROBE_MAX)
        if self.since_probe[b] >= interval or self.get(num_seqs, other).n == 0:
            self.since_probe[b] = 0
            if self.PROBE_CYCLES > 1:
                self.probing[b] = (other, self.PROBE_CYCLES - 1)
            # A probe's cycles outweigh the history before it: the other mode's cost, and what its
            # drafts make, may have moved.
            extras = [self.extra.get((b, sampled)) for sampled in (False, True)] if other == "spec" else []
            for c in (self.get(num_seqs, other), *extras):
                if c is not None:
                    c.real, c.predicted = c.real * 0.3, c.predicted * 0.3
            return other
        return wanted

    def skipped(self, num_seqs: int) -> None:
        """A plain cycle that reused an earlier plan (mode() not asked): it counts towards the next probe."""
        b = self.bucket(num_seqs)
        self.since_probe[b] = self.since_probe.get(b, 0) + 1

    def observe(self, num_seqs: int, mode: str, seconds: float, predicted_seconds: float,
                accepted: float = 0.0, predicted_accepted: float = 0.0, sampled: bool = False) -> None:
        """A cycle of this mode: its seconds against those predicted, and for a speculative one the
        drafts accepted in it against those predicted (sampled: a sequence of the step samples)."""
        if mode in ("plain", "spec") and seconds > 0 and predicted_seconds > 0:
            self.get(num_seqs, mode).observe(seconds, predicted_seconds, self.DECAY)
        if mode == "spec" and predicted_accepted > 0 and num_seqs > 1:  # not one stream (extra_scale)
            extra = self.extra.setdefault((self.bucket(num_seqs), sampled), _Ratio())
            extra.observe(accepted, predicted_accepted, self.DECAY)
