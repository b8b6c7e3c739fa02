"""ngram proposer (prompt lookup): continue the longest suffix n-gram seen earlier.

Semantics follow vLLM's NgramProposer (vllm/v1/spec_decode/ngram_proposer.py,
`_find_longest_matched_ngram_and_propose_tokens`, and its earlier KMP version
`_find_subarray_kmp`): the last n committed tokens, for n from prompt_lookup_max down to
prompt_lookup_min, are looked up among the *earlier* n-grams of the same sequence (the
suffix itself does not count, an overlapping earlier occurrence does). The longest n with
a match wins; among several occurrences of that n-gram the **earliest** one is used (vLLM
keeps the first match); the drafts are the up-to-k tokens that followed it, cut at the end
of the context. Defaults as vLLM's SpeculativeConfig: neither key given → 5/5, one given →
the other equals it.

Instead of vLLM's scan of the whole context every step, each sequence keeps an index
n-gram → end position of its first occurrence that has a successor. Each committed token
adds (max - min + 1) entries, each step is max - min + 1 dict lookups: O(max^2) per token,
independent of the context length.

Token trees (tree_branches b > 1): the index also keeps, per n-gram, up to b earlier
occurrences whose next tokens differ; the longest matched n-gram's occurrences become the
root's children (the first occurrence first, so branch 0 is the chain drafts), each
continued as a chain of up to k tokens, at most tree_max_nodes nodes in all.
"""
from __future__ import annotations

import time
from typing import Callable

from specd.proposers.base import IndexDrafter, Proposal, ProposeRequest, TokenHistories, register

VLLM_DEFAULT_LOOKUP = 5  # vLLM: "arbitrarily chosen"; both keys default to 5


def resolve_lookup(prompt_lookup_min: int | None, prompt_lookup_max: int | None) -> tuple[int, int]:
    lo, hi = prompt_lookup_min, prompt_lookup_max
    if lo is None and hi is None:
        lo = hi = VLLM_DEFAULT_LOOKUP
    elif lo is None:
        lo = hi
    elif hi is None:
        hi = lo
    if lo < 1 or hi < 1:
        raise ValueError(f"prompt_lookup_min ({lo}) and prompt_lookup_max ({hi}) must be >= 1")
    if lo > hi:
        raise ValueError(f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
    return lo, hi


class _NgramIndex:
    """n-gram (as a tuple) → end index of its first occurrence that is followed by a token."""

    __slots__ = ("min_n", "max_n", "first_end", "indexed", "branches", "ends")

    def __init__(self, min_n: int, max_n: int, branches: int = 1):
        self.min_n, self.max_n = min_n, max_n
        self.first_end: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending at positions < indexed are in first_end
        self.branches = branches
        # branches > 1: n-gram -> ends of its earliest occurrences with distinct next tokens
        self.ends: dict[tuple[int, ...], list[int]] = {}

    def extend(self, tokens: list[int]) -> None:
        # An n-gram ending at `end` has a successor once len(tokens) > end + 1.
        first_end = self.first_end
        for end in range(self.indexed, len(tokens) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                key = tuple(tokens[end - n + 1: end + 1])
                first_end.setdefault(key, end)
                if self.branches > 1:
                    ends = self.ends.setdefault(key, [])
                    if len(ends) < self.branches and all(tokens[e + 1] != tokens[end + 1] for e in ends):
                        ends.append(end)
        self.indexed = max(self.indexed, len(tokens) - 1)

    def lookup_tree(self, tokens: list[int], k: int, max_nodes: int) -> tuple[list[int], list[int]]:
        """(drafts, parents): each occurrence of the longest matched n-gram continued as a branch."""
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            ends = self.ends.get(tuple(tokens[-n:]))
            if ends:
                drafts, parents = [], []
                for end in ends:
                    branch = tokens[end + 1: end + 1 + min(k, max_nodes - len(drafts))]
                    for j, t in enumerate(branch):
                        parents.append(-1 if j == 0 else len(drafts) - 1)
                        drafts.append(t)
                return drafts, parents
        return [], []

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            end = self.first_end.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end + 1: end + 1 + k]
        return []


@register("ngram")
class NgramProposer(IndexDrafter):
    def __init__(self, num_speculative_tokens: int = 4, prompt_lookup_min: int | None = None,
                 prompt_lookup_max: int | None = None, ttl_seconds: float | None = 600.0,
                 clock: Callable[[], float] = time.monotonic, tree_branches: int = 1, tree_max_nodes: int = 32,
                 **other_methods_keys):
        unknown = [key for key in other_methods_keys if not key.startswith("suffix_decoding_")]
        if unknown:  # a shared SpeculativeConfig passes every method's keys; anything else is a typo
            raise TypeError(f"unknown option(s) for the ngram proposer: {', '.join(sorted(unknown))}")
        self.k = num_speculative_tokens  # the most drafts per step (a request's k is capped by it)
        self.min_n, self.max_n = resolve_lookup(prompt_lookup_min, prompt_lookup_max)
        self.histories = TokenHistories(ttl_seconds, clock)
        self.tree_branches, self.tree_max_nodes = tree_branches, tree_max_nodes
        self.index: dict[int, _NgramIndex] = {}

    def _propose_one(self, req: ProposeRequest, tokens: list[int], rebuild: bool, k: int) -> Proposal:
        index = None if rebuild else self.index.get(req.seq_id)
        if index is None:
            index = self.index[req.seq_id] = _NgramIndex(self.min_n, self.max_n, self.tree_branches)
        index.extend(tokens)
        if self.tree_branches > 1:
            drafts, parents = index.lookup_tree(tokens, k, self.tree_max_nodes) if k > 0 else ([], [])
            return Proposal(req.seq_id, drafts, parents=parents)
        return Proposal(req.seq_id, index.lookup(tokens, k) if k > 0 else [])

    def _forget(self, seq_id: int) -> None:
        self.index.pop(seq_id, None)

    def release(self, seq_ids: list[int]) -> None:
        self.histories.release(seq_ids)
        for sid in seq_ids:
            self.index.pop(sid, None)
