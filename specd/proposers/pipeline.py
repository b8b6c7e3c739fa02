"""Pipelined drafting: while the verifier verifies step t, the drafter drafts step t + 1 for the
most likely outcomes of step t, into a draft cache that the next request reads at once.

An outcome of verifying drafts d1..dk after a committed length L is "the first j drafts
accepted, then the target's own token c" (j = k: all accepted, c the bonus token): the
committed history grows by d1..dj, c. The drafter guesses c (its next-best token where a
draft is rejected, its own choice after dk), ranks the outcomes by its own probabilities,
and drafts the best ones as tentative requests (ProposeRequest.tentative: the proposer
drafts as if the delta were committed and keeps its state as it was). Each result goes into
the cache under (sequence, committed length, the delta). When the verifier's next request
brings the real delta, a match is answered from the cache; a miss is proposed as usual.

Lossless by construction: a cached proposal is the drafter's proposal for exactly the
history it is used with (sampled drafts carry the q they were drawn from, seeded ones the
same draws: draft seeds depend on the position only), and the verifier's acceptance
randomness never depends on drafts.

Chain heads (EAGLE) also need the target's states for the delta, which only the verify step
computes: a tentative request carries the head's own predictions of them (the states it
drafted d1..dj from, Proposal.draft_features), as its drafting does after the first draft.
The next real request brings the target's states, so the committed state is always exact.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from specd.proposers.base import Proposal, ProposeRequest

# Measured on the default pair (bf16, 1 thread, 4 chat prompts x 96 tokens, greedy, k = 4, forks
# drafting together): 3 guesses per position and 8 outcomes: hit rate 0.25 in 29 ms of drafting
# ahead per step; 5 and 16: 0.30 in 45 ms (a verify step there takes ~70 ms).
DEFAULT_BRANCHES = 16  # outcomes drafted ahead per sequence at most (best first; a new request stops it)
DEFAULT_ALTERNATIVES = 5  # guesses per draft position at the target's token, should it reject the draft
ROUND = 8  # outcomes per batch: a request that arrives meanwhile waits for one round at most


def record_alternatives(prop: Proposal, logits: torch.Tensor, token: int, req: ProposeRequest,
                        token_ids: torch.Tensor | None = None) -> None:
    """Append the drafter's probability of `token` and its req.alternatives next-best tokens
    (with probabilities) to prop, from the logits the draft came from (at the request's
    temperature when sampled; token_ids maps a head's draft vocabulary to target ids)."""
    logits = logits.float()
    if req.temperature and req.temperature > 0:
        logits = logits / req.temperature
    probs = logits.softmax(-1)
    top = probs.topk(min(req.alternatives + 1, probs.shape[-1]))
    ids = top.indices if token_ids is None else token_ids[top.indices]
    alts = [(int(t), float(p)) for t, p in zip(ids.tolist(), top.values.tolist()) if t != token]
    own = probs[(token_ids == token).nonzero()[0, 0]] if token_ids is not None else probs[token]
    prop.draft_probs.append(float(own))
    prop.alternatives.append(alts[:req.alternatives])


@dataclass
class Branch:
    """One outcome to draft ahead for: the (tentative) request that would follow it, and its
    probability by the drafter's own estimate."""

    request: ProposeRequest
    prob: float
    guess_first: bool = False  # all drafts accepted: draft 1 guesses the bonus token


def plan(req: ProposeRequest, prop: Proposal, max_branches: int) -> list[Branch]:
    """The likely outcomes of verifying prop (the answer to req), best first."""
    drafts, k = prop.token_ids, req.k
    if not drafts or prop.draft_probs is None or prop.parents is not None:
        return []
    base = req.num_tokens
    out, reach = [], 1.0  # reach: the drafter's probability that drafts 1..j are accepted
    for j, (own, alts) in enumerate(zip(prop.draft_probs, prop.alternatives)):
        for token, p in alts:  # draft j + 1 rejected, the target says `token`
            out.append(Branch(_tentative(req, prop, drafts[:j] + [token], base, k), reach * p))
        reach *= own
    # All accepted: one more draft guesses the bonus token, the next k are the pre-drafts.
    out.append(Branch(_tentative(req, prop, list(drafts), base, k + 1), reach, guess_first=True))
    out.sort(key=lambda b: -b.prob)
    return out[:max_branches]


def _tentative(req: ProposeRequest, prop: Proposal, delta: list[int], base: int, k: int) -> ProposeRequest:
    features = None
    if req.features is not None:  # a hidden-state drafter: stand-in rows for the delta
        if prop.draft_features is None or prop.draft_features.shape[0] < len(delta):
            features = torch.empty(0)  # no stand-in states: the proposer answers nothing
        else:
            features = prop.draft_features[:len(delta)]
    return replace(req, new_tokens=delta, num_tokens=base + len(delta), k=k, full_history=False,
                   features=features, tentative=True)


def _slice(prop: Proposal, start: int, end: int | None = None) -> Proposal:
    """prop's drafts [start:end], with everything kept per draft (a bonus-guess branch drops its
    first draft, the guess; a hit gives at most the k asked for)."""
    def cut(xs):
        return xs[start:end] if xs is not None else None

    return replace(prop, token_ids=prop.token_ids[start:end], q_ids=cut(prop.q_ids), q_probs=cut(prop.q_probs),
                   draft_probs=cut(prop.draft_probs), alternatives=cut(prop.alternatives),
                   draft_features=cut(prop.draft_features))


def _ewma(old: float, new: float) -> float:
    return new if old == 0.0 else 0.8 * old + 0.2 * new


@dataclass
class _Entry:
    request: ProposeRequest  # the tentative request it answers (its delta, k, sampling)
    proposal: Proposal


class PipelinedProposer:
    """A proposer that drafts ahead: propose() answers from the draft cache where it can, and
    predraft() (called while the verifier verifies: the drafter service runs it after each
    reply) fills the cache for the outcomes of the proposals just sent."""

    def __init__(self, proposer, max_branches: int = DEFAULT_BRANCHES, alternatives: int = DEFAULT_ALTERNATIVES):
        if not getattr(proposer, "supports_tentative", False):
            raise ValueError(f"{type(proposer).__name__} cannot draft ahead (pipelined drafting needs chain drafts "
                             "from draft_model or an EAGLE head)")
        self.proposer, self.max_branches, self.alternatives = proposer, max_branches, alternatives
        self.cache: dict[int, list[_Entry]] = {}  # seq_id -> drafts for its candidate outcomes
        self.pending: list[Branch] = []  # outcomes still to draft, best first
        self.hits = self.misses = self.predrafted = 0
        # A round that outlasts the verify step delays the next request (it waits for the round):
        # start one only if it should end in time, by the recent gaps between requests and rounds.
        self.gap_s = self.round_s = 0.0  # EWMAs: reply -> next request; one round of drafting ahead
        self._replied_at: float | None = None

    def __getattr__(self, name):  # vocab_size, feature_layers, ...: the proposer's
        return getattr(self.proposer, name)

    def propose(self, batch: list[ProposeRequest]) -> list[Proposal]:
        self.pending = []  # the verifier moved on: earlier guesses are moot
        if self._replied_at is not None:
            # an idle pause is not a verify step
            self.gap_s = _ewma(self.gap_s, min(time.perf_counter() - self._replied_at, 1.0))
        out: dict[int, Proposal] = {}
        deltas, asked = [], []
        for req in batch:
            hit = None if req.full_history or req.tentative else self._take(req)
            self.cache.pop(req.seq_id, None)
            if hit is None:
                if req.k > 0:
                    self.misses += 1
                asked.append(replace(req, alternatives=self.alternatives))
            else:
                self.hits += 1
                out[req.seq_id] = replace(_slice(hit.proposal, 0, req.k), cached=True)
                deltas.append(replace(req, k=0))  # the state follows the committed tokens
        for p in self.proposer.propose(deltas + asked):
            if p.seq_id not in out or p.resync:  # a hit whose delta did not apply: resync all the same
                out[p.seq_id] = p
        for r in batch:
            if r.k > 0:
                self.pending += plan(r, out[r.seq_id], self.max_branches)
        self.pending.sort(key=lambda b: -b.prob)
        self._replied_at = time.perf_counter()
        return [self._public(out[r.seq_id]) for r in batch]

    def _take(self, req: ProposeRequest) -> _Entry | None:
        for e in self.cache.get(req.seq_id, ()):
            t = e.request
            if (t.num_tokens == req.num_tokens and t.new_tokens == req.new_tokens and t.temperature == req.temperature
                    and t.seed == req.seed and e.proposal.token_ids):
                return e
        return None

    @staticmethod
    def _public(p: Proposal) -> Proposal:
        # What goes back to the caller; the records stay in the cache entries.
        return replace(p, draft_probs=None, alternatives=None, draft_features=None)

    def predraft(self, should_stop: Callable[[], bool] = lambda: False, in_time: bool = False) -> int:
        """Draft the pending outcomes best first until none is left or should_stop(). A proposer
        that forks sequences (tentative_batches) drafts a round of up to ROUND outcomes in one
        batch, several per sequence; others one outcome per sequence per round (they
        hold one state per sequence). in_time: start a round only if it should end before the
        next request arrives (the service). Returns how many outcomes were drafted."""
        done = 0
        forks = getattr(self.proposer, "tentative_batches", False)
        while self.pending and not should_stop():
            elapsed = time.perf_counter() - (self._replied_at or 0.0)
            if in_time and self.gap_s and self.round_s and elapsed + self.round_s > self.gap_s:
                break  # it would end after the next request arrives
            started = time.perf_counter()
            round_, rest, seen = [], [], set()
            for b in self.pending:
                fits = len(round_) < ROUND if forks else b.request.seq_id not in seen
                (round_ if fits else rest).append(b)
                seen.add(b.request.seq_id)
            self.pending = rest
            props = self.proposer.propose([replace(b.request, alternatives=self.alternatives) for b in round_])
            for b, p in zip(round_, props):
                if b.guess_first and p.token_ids:
                    guess = p.token_ids[0]
                    p = _slice(p, 1)
                    req = replace(b.request, new_tokens=b.request.new_tokens + [guess],
                                  num_tokens=b.request.num_tokens + 1, k=b.request.k - 1)
                else:
                    req = b.request
                if p.token_ids:
                    self.cache.setdefault(req.seq_id, []).append(_Entry(req, p))
                    done += 1
            self.round_s = _ewma(self.round_s, time.perf_counter() - started)
        self.predrafted += done
        return done

    def release(self, seq_ids: list[int]) -> None:
        gone = set(seq_ids)
        for sid in gone:
            self.cache.pop(sid, None)
        self.pending = [b for b in self.pending if b.request.seq_id not in gone]
        self.proposer.release(seq_ids)
