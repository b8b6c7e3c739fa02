"""suffix proposer (SuffixDecoding, Oliaro et al. 2024; vLLM method "suffix", which wraps
Arctic Inference's SuffixDecodingCache).

Two indexes of suffixes, both bounded by suffix_decoding_max_tree_depth (D): every suffix
of a sequence counts up to D tokens, so a string's count is its number of occurrences.
  - one per active request, over its prompt and output, extended as tokens are committed:
    a SequenceIndex, the positions of each token, which answers as the suffix trie of that
    one sequence would (a trie of a 600-token prompt at D = 24 is 14k Python nodes, ~30 ms
    to build on first contact; the positions take ~0.1 ms, and a draft filters them);
  - one global trie over the outputs ("responses") of the most recent
    suffix_decoding_max_cached_requests finished requests, evicted FIFO (0 disables it); a
    request that asked to keep its answer out (cache_output=False) still drafts from it.
    A request's response enters it when the request is released (explicitly or by TTL).
And, with suffix_decoding_datastore (a directory), a datastore fixed ahead of time (datastore.py;
models/SmolLM2-135M-Instruct-datastore holds the default target's own answers), read as the global
trie is.

One step, as Arctic's SuffixTree::speculate / _speculate_path:
  for each match length m = 1, 2, ... (m < len(context), context = the last D tokens)
  whose m-token suffix is in the trie, draft greedily from the matched node: follow the
  child with the highest count while the path probability (the product of
  child.count / node.count along the path) stays >= suffix_decoding_min_token_prob, for at
  most min(k, int(m * suffix_decoding_max_spec_factor)) tokens (and the trie depth
  bounds m + drafts <= D). The draft's score is the sum of its path probabilities
  (the expected number of accepted tokens). The request's own draft, where it has one, stands;
  only where it has none do the global trie and the datastore draft, the better-scoring of them
  (the shorter match on ties). Arctic compares all by score alone: a frequent string of other
  answers then outscores the request's own, rarer continuation and is accepted less. Each
  proposal says which source drafted it (Proposal.source), and the controller keeps their
  acceptance apart.
Ties between children of equal count go to the most recently seen one (Arctic leaves
them to hash order). Drafts are deterministic, so q is one-hot and only ids travel.

Differences from Arctic, on purpose: a response enters the global cache when its request
ends rather than token by token (nothing of a live request is in the global trie, so a
rollback never has to touch it), and we have no prompt/response boundary on the wire
unless the caller sends num_prompt_tokens: without it the prompt is taken to be the
history of the first contact.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable

from specd.proposers.base import IndexDrafter, Proposal, ProposeRequest, TokenHistories, register
from specd.proposers.datastore import Datastore


class _Node:
    __slots__ = ("count", "last", "children", "best")

    def __init__(self):
        self.count = 0     # occurrences of the path's token string
        self.last = 0      # tick of the latest occurrence (tie-break between equal counts)
        self.children: dict[int, _Node] = {}
        # The child a draft follows: highest (count, last), kept as tokens are added (a node near
        # the root has hundreds of children; taking their max on every draft step cost most of a
        # propose call); None where a removal may have changed it (recomputed when next read).
        self.best: int | None = None

    def best_child(self) -> tuple[int, "_Node"]:
        if self.best is None:
            self.best = max(self.children.items(), key=lambda kv: (kv[1].count, kv[1].last))[0]
        return self.best, self.children[self.best]


class SuffixTrie:
    """All suffixes of one or more token sequences, each cut at max_depth tokens."""

    def __init__(self, max_depth: int):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node()
        self.tick = 0

    def extend(self, open_nodes: list[_Node], tokens: list[int]) -> list[_Node]:
        """Append tokens to a sequence whose still-growing suffixes end at open_nodes
        (oldest first, at most max_depth - 1 of them); returns the new open nodes."""
        keep = self.max_depth - 1
        for tok in tokens:
            self.tick += 1
            self.root.count += 1
            grown = []
            for node in open_nodes + [self.root]:
                child = node.children.get(tok)
                if child is None:
                    child = node.children[tok] = _Node()
                child.count += 1
                child.last = self.tick
                # the newest occurrence wins ties, so a child that reaches the best's count is the best
                if node.best is None or node.best == tok or child.count >= node.children[node.best].count:
                    node.best = tok
                grown.append(child)
            open_nodes = grown[-keep:] if keep else []
        return open_nodes

    def remove(self, tokens: list[int]) -> None:
        """Take one sequence previously added with extend() out again."""
        for start in range(len(tokens)):
            self.root.count -= 1
            node = self.root
            for tok in tokens[start: start + self.max_depth]:
                child = node.children[tok]
                child.count -= 1
                node.best = None
                if child.count == 0:
                    del node.children[tok]  # nothing else passes through: drop the subtree
                    break
                node = child

    def match(self, pattern: list[int]) -> _Node | None:
        node = self.root
        for tok in pattern:
            node = node.children.get(tok)
            if node is None:
                return None
        return node

    def speculate(self, context: list[int], max_spec_tokens: int, max_spec_factor: float,
                  min_token_prob: float) -> tuple[list[int], float, int]:
        """(draft, score, match_len) of the best-scoring match of a suffix of context."""
        context = context[-self.max_depth:]
        best: tuple[list[int], float, int] = ([], 0.0, 0)
        for match_len in range(1, len(context)):
            node = self.match(context[len(context) - match_len:])
            if node is None:
                break  # the trie holds every substring of its sequences: longer ones miss too
            limit = min(max_spec_tokens, int(match_len * max_spec_factor + 1e-6))
            draft, score = self._follow(node, limit, min_token_prob)
            if score > best[1]:
                best = (draft, score, match_len)
        return best

    @staticmethod
    def _follow(node: _Node, limit: int, min_token_prob: float) -> tuple[list[int], float]:
        draft, score, prob = [], 0.0, 1.0
        while len(draft) < limit and node.children:
            tok, child = node.best_child()
            prob *= child.count / node.count
            if prob < min_token_prob:
                break
            draft.append(tok)
            score += prob
            node = child
        return draft, score


class SequenceIndex:
    """One growing sequence's suffixes, as the positions where each token ends an occurrence.
    speculate() gives what SuffixTrie(max_depth).speculate gives for a trie of this sequence
    alone, its context being the sequence itself: the node of a string is the set of positions
    where the string ends (its count their number, its newest occurrence the last of them), and
    a child's set is the positions one further that hold the child's token."""

    def __init__(self, max_depth: int):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.tokens: list[int] = []
        self.ends: dict[int, list[int]] = {}  # token -> positions holding it, ascending

    def extend(self, tokens: list[int]) -> None:
        for tok in tokens:
            self.ends.setdefault(tok, []).append(len(self.tokens))
            self.tokens.append(tok)

    def speculate(self, max_spec_tokens: int, max_spec_factor: float,
                  min_token_prob: float) -> tuple[list[int], float, int]:
        """(draft, score, match_len) of the best-scoring match of a suffix of the sequence."""
        tokens, n = self.tokens, len(self.tokens)
        best: tuple[list[int], float, int] = ([], 0.0, 0)
        if not n:
            return best
        ends = self.ends[tokens[-1]]  # the 1-token suffix's occurrences (the last one: the end)
        path = None
        for match_len in range(1, min(n, self.max_depth)):
            if match_len > 1:
                tok = tokens[n - match_len]
                longer = [e for e in ends if e >= match_len - 1 and tokens[e - match_len + 1] == tok]
                if len(longer) < len(ends):  # a subset: the same length is the same occurrences
                    ends, path = longer, None
            if len(ends) == 1:
                break  # only the sequence's own end: nothing follows it, nor any longer match
            limit = min(max_spec_tokens, int(match_len * max_spec_factor + 1e-6), self.max_depth - match_len)
            # Matches with the same occurrences follow the same path, as far as each one's limit.
            path = path or _Path(tokens, ends, min_token_prob)
            draft, score = path.take(limit)
            if score > best[1]:
                best = (draft, score, match_len)
        return best


class _Path:
    """The draft a SequenceIndex match follows from its occurrences, grown as far as asked:
    the child with the most occurrences (the newest on ties), while the path's probability
    stays >= min_token_prob."""

    def __init__(self, tokens: list[int], ends: list[int], min_token_prob: float):
        self.tokens, self.ends, self.min_token_prob = tokens, ends, min_token_prob
        self.draft: list[int] = []
        self.scores: list[float] = []  # the score of each draft prefix (sum of path probabilities)
        self.prob, self.done = 1.0, False

    def take(self, limit: int) -> tuple[list[int], float]:
        while len(self.draft) < limit and not self.done:
            self._grow()
        k = min(limit, len(self.draft))
        return self.draft[:k], self.scores[k - 1] if k else 0.0

    def _grow(self) -> None:
        tokens, n = self.tokens, len(self.tokens)
        children: dict[int, list[int]] = {}
        for e in self.ends:
            if e + 1 < n:
                children.setdefault(tokens[e + 1], []).append(e + 1)
        if not children:
            self.done = True
            return
        tok, nxt = max(children.items(), key=lambda kv: (len(kv[1]), kv[1][-1]))
        prob = self.prob * (len(nxt) / len(self.ends))  # as the trie rounds it
        if prob < self.min_token_prob:
            self.done = True
            return
        self.draft.append(tok)
        self.scores.append((self.scores[-1] if self.scores else 0.0) + prob)
        self.prob, self.ends = prob, nxt


class _Request:
    __slots__ = ("index", "prompt_len", "cache_output")

    def __init__(self, max_depth: int, prompt_len: int, cache_output: bool):
        self.index = SequenceIndex(max_depth)
        self.prompt_len = prompt_len
        self.cache_output = cache_output  # False: its response never enters the global cache


@register("suffix")
class SuffixProposer(IndexDrafter):
    def __init__(self, num_speculative_tokens: int = 4, suffix_decoding_max_tree_depth: int = 24,
                 suffix_decoding_max_cached_requests: int = 10000, suffix_decoding_max_spec_factor: float = 1.0,
                 suffix_decoding_min_token_prob: float = 0.1, suffix_decoding_datastore: str | None = None,
                 ttl_seconds: float | None = 600.0, clock: Callable[[], float] = time.monotonic,
                 **other_methods_keys):
        unknown = [key for key in other_methods_keys if not key.startswith("prompt_lookup_")]
        if unknown:  # a shared SpeculativeConfig passes every method's keys; anything else is a typo
            raise TypeError(f"unknown option(s) for the suffix proposer: {', '.join(sorted(unknown))}")
        if suffix_decoding_max_spec_factor <= 0:
            raise ValueError("suffix_decoding_max_spec_factor must be > 0")
        if not 0 <= suffix_decoding_min_token_prob <= 1:
            raise ValueError("suffix_decoding_min_token_prob must be in [0, 1]")
        self.k = num_speculative_tokens  # the most drafts per step (a request's k is capped by it)
        self.max_depth = suffix_decoding_max_tree_depth
        self.max_cached = suffix_decoding_max_cached_requests  # 0: no global cache; < 0: unbounded
        self.max_spec_factor = suffix_decoding_max_spec_factor
        self.min_token_prob = suffix_decoding_min_token_prob
        self.histories = TokenHistories(ttl_seconds, clock)
        self.requests: dict[int, _Request] = {}
        self.global_trie = SuffixTrie(self.max_depth)
        self.cached: OrderedDict[int, list[int]] = OrderedDict()  # FIFO of cached responses
        self._next_cache_id = 0
        self.datastore = Datastore.load(suffix_decoding_datastore, self.max_depth) if suffix_decoding_datastore else None

    def _propose_one(self, req: ProposeRequest, tokens: list[int], rebuild: bool, k: int) -> Proposal:
        state = self._sync_trie(req, tokens, rebuild)
        draft, source = self._draft(state, tokens, k, req.skip_sources) if k > 0 else ([], "")
        return Proposal(req.seq_id, draft, source=source)

    def _forget(self, seq_id: int) -> None:
        self.requests.pop(seq_id, None)

    def _sync_trie(self, req: ProposeRequest, tokens: list[int], rebuild: bool) -> _Request:
        state = self.requests.get(req.seq_id)
        if rebuild:
            prompt_len = state.prompt_len if state is not None else len(tokens)
            state = None
            self.requests.pop(req.seq_id, None)
        if state is None:
            prompt_len = req.num_prompt_tokens if req.num_prompt_tokens is not None else prompt_len
            state = self.requests[req.seq_id] = _Request(self.max_depth, min(prompt_len, len(tokens)), req.cache_output)
        elif req.num_prompt_tokens is not None:
            state.prompt_len = req.num_prompt_tokens
        state.index.extend(tokens[len(state.index.tokens):])
        return state

    def _draft(self, state: _Request, tokens: list[int], k: int, skip: frozenset[str] = frozenset()) -> tuple[list[int], str]:
        """-> (draft, the source that drafted it: "own", "cache" or "datastore"). The request's own
        draft first; the other sources (unless in skip: ProposeRequest.skip_sources) only without
        one: other answers' counts overstate how likely a continuation is in this one. Served
        in one process (bench/suffix_datastore.py, 2-core Xeon with AMX, the datastore's sources kept
        apart by the controller), server's choice / plain, chat batch 1, summaries batch 1, code edits
        batch 8: own first 1.48x, 1.65x, 1.65x; the other's draft where it scored over twice the own
        1.33x, 1.57x, 1.55x (a replay of held-out answers, which prices no rows, had ranked that rule
        first: 1.74, 2.90, 3.91 tokens a step against 1.71, 2.87, 3.84)."""
        best, _, _ = state.index.speculate(k, self.max_spec_factor, self.min_token_prob)
        if best:
            return best, "own"
        best_source, best_score = "own", 0.0
        for name, source in (("cache", self.global_trie if self.cached else None), ("datastore", self.datastore)):
            if source is None or name in skip:
                continue
            draft, score, _ = source.speculate(tokens, k, self.max_spec_factor, self.min_token_prob)
            if score > best_score:
                best, best_source, best_score = draft, name, score
        return best, best_source

    def release(self, seq_ids: list[int]) -> None:
        """The requests ended: their responses move into the global cache (unless a request asked
        that its answer not be kept: cache_output=False)."""
        for sid in seq_ids:
            tokens = self.histories.tokens.get(sid)
            state = self.requests.pop(sid, None)
            if state is not None and state.cache_output and tokens is not None:
                self._cache(tokens[state.prompt_len:])
        self.histories.release(seq_ids)

    def _cache(self, response: list[int]) -> None:
        if self.max_cached == 0 or not response:
            return
        response = list(response)
        self.global_trie.extend([], response)
        self.cached[self._next_cache_id] = response
        self._next_cache_id += 1
        while 0 < self.max_cached < len(self.cached):
            _, oldest = self.cached.popitem(last=False)
            self.global_trie.remove(oldest)
