"""The proposers' registry (PROPOSERS, @register) and what several proposers share: token
histories per sequence with resync detection and TTL release, the index drafters' propose()
loop (IndexDrafter), feature-row counts. The contract
they implement (ProposeRequest, Proposal, Proposer) is specd/engine/spec/proposal.py, with its caller.
"""
from __future__ import annotations

import time
from typing import Callable

from specd.engine.spec.proposal import Proposal, ProposeRequest, Proposer  # noqa: F401  (the proposers' names for it)


def feature_rows(req) -> int:
    """How many feature rows `req` (a ProposeRequest or a wire ProposeEntry) must carry."""
    if req.full_history:  # one row per pair from features_from on (the first token predicts nothing)
        return max(len(req.new_tokens) - 1 - req.features_from, 0)
    return len(req.new_tokens)


PROPOSERS: dict[str, Callable[..., Proposer]] = {}


def register(name: str):
    def wrap(cls):
        PROPOSERS[name] = cls
        return cls

    return wrap


class TokenHistories:
    """Committed token history per sequence, with resync detection and TTL release."""

    def __init__(self, ttl_seconds: float | None = 600.0, clock: Callable[[], float] = time.monotonic):
        self.ttl, self.clock = ttl_seconds, clock
        self.tokens: dict[int, list[int]] = {}
        self.touched: dict[int, float] = {}

    def sync(self, req: ProposeRequest) -> list[int] | None:
        """The history after applying req, or None when out of sync (state dropped)."""
        known = self.tokens.get(req.seq_id)
        if req.full_history:
            known = self.tokens[req.seq_id] = list(req.new_tokens)
        elif known is None or len(known) + len(req.new_tokens) != req.num_tokens:
            self.release([req.seq_id])
            return None
        else:
            known.extend(req.new_tokens)
        if len(known) != req.num_tokens:
            self.release([req.seq_id])
            return None
        self.touched[req.seq_id] = self.clock()
        return known

    def release(self, seq_ids: list[int]) -> None:
        for sid in seq_ids:
            self.tokens.pop(sid, None)
            self.touched.pop(sid, None)

    def expired(self, now: float | None = None) -> list[int]:
        """Sequences not touched for more than ttl seconds (None ttl: never expire)."""
        if self.ttl is None:
            return []
        now = self.clock() if now is None else now
        return [sid for sid, t in self.touched.items() if now - t > self.ttl]


def release_expired(proposer, histories: TokenHistories, now: float | None = None) -> list[int]:
    """TTL release: release (through the proposer, so its own state goes too) every
    sequence whose history was not touched for more than histories.ttl seconds."""
    expired = histories.expired(now)
    if expired:
        proposer.release(expired)
    return expired


class IndexDrafter:
    """What the index drafters (ngram, suffix) share: a committed history per sequence
    (self.histories), a request's k capped at self.k, and propose()'s loop. Each call first
    releases the sequences past their TTL; a request out of sync has its state dropped
    (_forget) and is answered resync; every other one is drafted by _propose_one."""

    answers_inline = True  # an index lookup in microseconds: a drafter service calls it on its event loop
    k: int  # the most drafts per step (a request's k is capped by it)
    histories: TokenHistories

    def propose(self, batch: list[ProposeRequest]) -> list[Proposal]:
        self.release_expired()
        out = []
        for req in batch:
            held = self.histories.tokens.get(req.seq_id)
            tokens = self.histories.sync(req)
            if tokens is None:
                self._forget(req.seq_id)  # out of sync: rebuilt from the full history
                out.append(Proposal(req.seq_id, [], resync=True))
                continue
            # first contact, or a committed history rolled back / replaced: the index starts over
            rebuild = req.full_history and not _extends(tokens, held)
            out.append(self._propose_one(req, tokens, rebuild, min(req.k, self.k)))
        return out

    def release_expired(self, now: float | None = None) -> list[int]:
        return release_expired(self, self.histories, now)

    def _forget(self, seq_id: int) -> None:
        """Drop the sequence's index (its history is gone already)."""
        raise NotImplementedError

    def _propose_one(self, req: ProposeRequest, tokens: list[int], rebuild: bool, k: int) -> Proposal:
        """The proposal for one request in sync: tokens is its committed history, k its cap."""
        raise NotImplementedError


def _extends(tokens: list[int], held: list[int] | None) -> bool:
    """tokens is held plus (maybe) more: a full-history resend that needs no rebuild."""
    return held is not None and len(held) <= len(tokens) and tokens[: len(held)] == held
