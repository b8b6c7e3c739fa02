"""What a proposer's answer may put into a step: drafts cut at the first bad entry.

A proposer (in process, or a drafter service over the wire) never corrupts output, it only costs
drafts: a token outside the vocabulary, a tree node whose parent is not before it or that lies
deeper than k, a sampled draft whose q is not a distribution holding it, all end the draft there.
"""
from __future__ import annotations

import math


class DraftValidator:
    def __init__(self, vocab_size: int, max_tree_nodes: int, lossy: bool):
        self.vocab_size = vocab_size
        self.max_tree_nodes = max_tree_nodes  # the most tree nodes one sequence may send (0: chains only)
        self.lossy = lossy  # lossy acceptance verifies chains only

    def validated(self, p, k: int):
        """Drafts cut at the first bad entry: a proposer never corrupts output, it only costs drafts.
        A tree (p.parents) keeps its first nodes up to max_tree_nodes while each has a parent
        before it and a depth of at most k (k + 1 tokens may commit); a prefix of a tree whose
        parents point backwards is a tree. -> (drafts, q, parents or None for a chain)."""
        parents = p.parents
        if parents is not None and (not self.max_tree_nodes or self.lossy):
            return [], None, None  # this engine verifies chains only (lossy acceptance: chains only)
        drafts, depth = [], []
        limit = k if parents is None else min(self.max_tree_nodes, len(parents))
        for i, t in enumerate(p.token_ids[:limit]):
            if not isinstance(t, int) or not 0 <= t < self.vocab_size:
                break
            if parents is not None:
                par = parents[i]
                if not isinstance(par, int) or not -1 <= par < i:
                    break
                d = 1 if par < 0 else depth[par] + 1
                if d > k:
                    break
                depth.append(d)
            drafts.append(t)
        q = None
        if p.q_ids:  # sampled drafts: the sparse q must be a distribution that contains the draft
            ok = p.q_probs is not None and len(p.q_ids) >= len(drafts) and len(p.q_probs) >= len(drafts)
            q = list(zip(p.q_ids, p.q_probs or []))[: len(drafts)] if ok else []
            if not ok or not all(self._valid_q(t, ids, probs) for t, (ids, probs) in zip(drafts, q)):
                return [], None, None
        return drafts, q, None if parents is None else list(parents[: len(drafts)])

    def _valid_q(self, draft: int, ids: list[int], probs: list[float]) -> bool:
        if not ids or len(ids) != len(probs) or len(set(ids)) != len(ids):
            return False
        if not all(0 <= i < self.vocab_size for i in ids) or not all(math.isfinite(x) and x >= 0 for x in probs):
            return False
        return abs(sum(probs) - 1.0) < 1e-3 and probs[ids.index(draft)] > 0 if draft in ids else False
