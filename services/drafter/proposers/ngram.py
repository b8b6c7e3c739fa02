"""ngram proposer (prompt lookup): continue the longest suffix n-gram seen earlier.

For n from prompt_lookup_max down to prompt_lookup_min, the last n committed tokens
are looked up among earlier n-grams of the same sequence; the tokens that followed
the match are the drafts. Among several earlier occurrences the most recent one is
used (the nearest context is the best predictor in generated code and text).
An incremental index (n-gram → end of its latest occurrence) makes each step
O(prompt_lookup_max) instead of a scan of the whole history.
"""
from __future__ import annotations

from specd.drafter.proposers.base import Proposal, ProposeRequest, TokenHistories, register

DEFAULT_LOOKUP_MIN, DEFAULT_LOOKUP_MAX = 2, 5


@register("ngram")
class NgramProposer:
    def __init__(self, num_speculative_tokens: int = 4, prompt_lookup_min: int | None = None,
                 prompt_lookup_max: int | None = None, ttl_seconds: float = 600.0, **_ignored):
        self.k = num_speculative_tokens
        self.max_n = prompt_lookup_max or max(prompt_lookup_min or 0, DEFAULT_LOOKUP_MAX)
        self.min_n = prompt_lookup_min or min(DEFAULT_LOOKUP_MIN, self.max_n)
        if self.min_n > self.max_n:
            raise ValueError(f"prompt_lookup_min ({self.min_n}) must be <= prompt_lookup_max ({self.max_n})")
        self.histories = TokenHistories(ttl_seconds)
        self.indexed: dict[int, int] = {}  # seq_id -> tokens already indexed
        self.index: dict[int, dict[tuple, int]] = {}

    def propose(self, batch: list[ProposeRequest]) -> list[Proposal]:
        out = []
        for req in batch:
            tokens = self.histories.sync(req)
            if tokens is None:
                self._drop(req.seq_id)
                out.append(Proposal(req.seq_id, [], resync=True))
                continue
            if req.full_history:
                self._drop(req.seq_id)
            self._extend_index(req.seq_id, tokens)
            out.append(Proposal(req.seq_id, self._lookup(req.seq_id, tokens, min(req.k, self.k))))
        return out

    def _extend_index(self, seq_id: int, tokens: list[int]) -> None:
        # Index every n-gram that has a successor: those ending at positions < len - 1.
        index = self.index.setdefault(seq_id, {})
        start = self.indexed.get(seq_id, 0)
        for end in range(start, len(tokens) - 1):
            for n in range(self.min_n, self.max_n + 1):
                if end - n + 1 >= 0:
                    index[tuple(tokens[end - n + 1: end + 1])] = end
        self.indexed[seq_id] = max(start, len(tokens) - 1)

    def _lookup(self, seq_id: int, tokens: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        index = self.index[seq_id]
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            end = index.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end + 1: end + 1 + k]
        return []

    def _drop(self, seq_id: int) -> None:
        self.index.pop(seq_id, None)
        self.indexed.pop(seq_id, None)

    def release(self, seq_ids: list[int]) -> None:
        self.histories.release(seq_ids)
        for sid in seq_ids:
            self._drop(sid)
