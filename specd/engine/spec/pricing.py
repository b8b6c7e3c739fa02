"""What a draft is expected to make: accepted tokens and verify rows per sequence, drafter and k,
as the plan (controller.py) weighs its options, read from the record (record.py).

PlanPrices is one plan's: made with the plan's inputs (the drafters that may draft, the requests
that named theirs, the drafts offered before it), it keeps what it computed for the rest of the
plan, which weighs every k and subset of drafters for every sequence. offers_may_pay prices an
in-process index's offers before they are asked for.
"""
from __future__ import annotations

from specd.engine.spec.acceptance import Positions, expected_tokens

DRAFTER_MARGIN = 1.10


class PlanPrices:
    def __init__(self, record, max_k: int, names: list[str | None], pinned: dict[int, str],
                 offered: dict[int, dict[str | None, int]], offer_sources: dict[int, dict[str | None, str]]):
        self.record, self.max_k, self.names = record, max_k, names
        self.pinned = pinned  # this step's sequences whose request named its drafter
        self.offered = offered  # this step's drafts made before the plan: lengths
        self.offer_sources = offer_sources  # and which source of the index made each
        self._ranked_by: dict[tuple[int, int], list] = {}  # drafters per (sequence, k): _ranked
        self._curves: dict[tuple, list] = {}  # position curves per (drafter, kind): curve

    def best_drafter(self, sid: int, k: int, subset: list[str | None],
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
            current, offered = self.record.current.get(sid), self.offered.get(sid, {})
            ranked = []
            for name in [self.pinned[sid]] if sid in self.pinned else self.names:
                alpha, made = self.record.estimates(sid, name)
                if name in offered:  # its draft is made: known rows, and it holds the history already
                    made = float(offered[name] > 0)
                    accepted, rows = self.offered_curve(sid, name, whole, offered[name])
                    ranked.append((made * accepted, name, made, rows))
                    continue
                accepted, rows = self.curve(sid, name, alpha, k)
                gain = made * accepted
                ranked.append((gain if current is None or name == current else gain / DRAFTER_MARGIN, name, made, rows))
            ranked.sort(key=lambda r: -r[0])  # stable: ties keep the drafters' order
            self._ranked_by[sid, k] = ranked
        return ranked

    def curve(self, sid: int, name: str | None, alpha: float, k: int) -> tuple[float, float]:
        """(accepted tokens, tokens drafted) expected of this sequence's draft capped at k: the
        drafter's positions, the accepted ones scaled by how this sequence's α (alpha) compares
        with the drafter's (with no position measured: exactly the geometric E(α, k) - 1)."""
        sampled = self.record.sampled.get(sid, False)
        curve = self._curves.get((name, sampled))
        if curve is None or len(curve) <= k:  # once per plan: the same for every sequence of the kind
            d = self.record.drafter(name)
            prior = self.record.alpha_prior(sid, d)
            curve = self._curves[name, sampled] = [
                (accepted / geometric if (geometric := expected_tokens(prior, j) - 1.0) > 1e-9 else None, rows)
                for j, (accepted, rows) in enumerate(d.positions[sampled].curve(max(k, self.max_k), prior))]
        per_geometric, rows = curve[k]
        if per_geometric is None:
            return 0.0, rows
        return min(per_geometric * (expected_tokens(alpha, k) - 1.0), rows), rows

    def offered_curve(self, sid: int, name: str | None, k: int, length: int) -> tuple[float, float]:
        """(accepted tokens, tokens drafted) expected of a draft of `length` tokens already offered,
        cut at k: what the drafter's drafts of that length from that source accepted (over all
        sequences of the kind). Not scaled by the sequence's own α, as a drafter asked after the plan
        is (curve): the offer's source and length already say whether it copies, and the sequence's
        α, read from the short drafts of prose, priced its next offers below what they made (chat at
        batch 1 in one process, a 2-core Xeon without AMX: the one-token offers the plan dropped made
        0.2 tokens each, as the ones it took; unscaled, 1.33-1.35x of plain decoding against
        1.29-1.30x, modeled by one verify-cost table; code edits and summaries alike)."""
        cut = min(k, length)
        if cut <= 0:
            return 0.0, 0.0
        sampled = self.record.sampled.get(sid, False)
        source = self.offer_sources.get(sid, {}).get(name, "")
        chain = self._curves.get((name, sampled, source, length))
        if chain is None:
            d = self.record.drafter(name)
            positions = d.by_length[sampled].get((source, length)) or Positions()
            chain = self._curves[name, sampled, source, length] = positions.chain(
                length, self.record.alpha_prior(sid, d), d.positions[sampled])
        return min(chain[cut], float(cut)), float(cut)


def offers_may_pay(record, name: str | None, num_seqs: int, base_tokens: int, cap: int,
                   kinds: set[bool]) -> tuple[bool, frozenset[str]]:
    """Whether a draft of some length up to cap that this in-process drafter offers could pay for
    its rows in a step of num_seqs sequences: its accepted tokens (the drafter's positions for
    that length) at the step's rate against the rows' cost, as plan() drops an offer. Where no
    length can, asking the index for every sequence is time lost (at batch 32 on a 2-core EPYC,
    asking and building each sequence's trie on first contact took 5.4% of the steps). -> (that,
    the sources of the index measured so far none of whose drafts could: not worth asking)."""
    # Calibrated as plan() rates its options: the times by what cycles of each mode took over what
    # was predicted, the accepted tokens by what speculative cycles made over their prediction (at
    # T 0.7, batch 8, a datastore's one-hot drafts made half what was predicted, and asked for on
    # that prediction cost 9% in one process). Read once: this runs every step.
    d, extra = record.drafter(name), record.calibration.extra_scale(num_seqs, True in kinds)
    spec_scale = record.calibration.scale(num_seqs, "spec")
    plain_s = record.verify_cost(base_tokens) / record.calibration.scale(num_seqs, "plain")
    step_s = [record.verify_cost(base_tokens + length) / spec_scale for length in range(cap + 1)]

    def may_pay(source: str, sampled: bool, length: int) -> bool:
        positions = d.by_length[sampled].get((source, length)) or Positions()
        accepted = extra * positions.chain(length, record.alpha_prior_of(d, sampled), d.positions[sampled])[length]
        return accepted * step_s[length] >= num_seqs * (step_s[length] - plain_s)

    sources = {s for kind in kinds for s, _ in d.by_length[kind]} | {""}
    paying = {s for s in sources if any(may_pay(s, sampled, length) for sampled in kinds for length in range(1, cap + 1))}
    return bool(paying), frozenset(s for s in sources - paying if s)
