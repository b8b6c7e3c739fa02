"""A datastore of token sequences to draft from, fixed ahead of time (REST, He et al. 2024:
retrieval from a datastore; here the datastore is the target's own answers, so it drafts what
this target says, and it is SuffixDecoding's global tree filled before the first request).

The suffix proposer asks it only where the request's own history has no draft (suffix.py). A
draft: the longest suffix of the context (at most max_depth - 1 tokens) that occurs in the datastore,
then, while the path's probability stays >= min_token_prob, the token that most often follows
the occurrences still on the path (the newest occurrence breaks ties, as the suffix trie
does), at most min(k, match length x max_spec_factor) tokens. Longer matches are tried first
and a shorter one only where the longer gives no draft.

The index: the sequences laid out back to front (R), and the start positions of R sorted by the
first max_depth tokens there, i.e. by the tokens that end at each position of the sequences, read
backwards. A context's last m tokens, read backwards, are then a range of that order, and the
last m + 1 tokens a range inside it: each longer match narrows the last one's range by bisection.
The order is built once, at load, by prefix doubling (~2 s for ~2M tokens); the bisections
compare byte strings (big-endian ids), so with memcmp.

On disk: a directory with `datastore.npz` (`tokens`: the sequences end to end, uint32;
`lengths`: each sequence's length) and `config.json` (`vocab_hash`: the tokenizer's id table,
as specd.models.tokenizer hashes it; what made it).
"""
from __future__ import annotations

import array
import bisect
import json
from pathlib import Path

import numpy as np

SEP = 0xFFFFFFFF  # between sequences: no match or draft crosses it
MODE_SAMPLE = 4096  # the most occurrences read to find the next token (a 1-token match has ~50k)
FILE = "datastore.npz"


def save(out: Path, sequences: list[list[int]], config: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tokens = np.fromiter((t for s in sequences for t in s), dtype=np.uint32)
    np.savez_compressed(out / FILE, tokens=tokens, lengths=np.array([len(s) for s in sequences], dtype=np.int64))
    (out / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")


def _sorted_starts(rev: np.ndarray, depth: int) -> np.ndarray:
    """The positions of rev (separators left out) sorted by the `depth` tokens from each (fewer at
    the end sort first, as a shorter byte string does), by prefix doubling: ranks by the first h
    tokens, then pairs of ranks (h and the next h) give the ranks by 2h. A few arrays of n int64
    (a Python sort keyed by byte strings held ~200 bytes a token at once)."""
    n = len(rev)
    rank = rev.astype(np.int64)
    order = np.argsort(rank, kind="stable")
    h = 1
    while h < depth:
        second = np.full(n, -1, dtype=np.int64)
        second[: n - h] = rank[h:]
        order = np.lexsort((second, rank))
        first, nxt = rank[order], second[order]
        new = np.empty(n, dtype=bool)
        new[:1] = True
        new[1:] = (first[1:] != first[:-1]) | (nxt[1:] != nxt[:-1])
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.cumsum(new) - 1
        del first, nxt, second, new
        if rank.max(initial=-1) == n - 1:
            break  # every position already apart
        h *= 2
    return order[rev[order] != SEP].astype(np.int64)


class Datastore:
    def __init__(self, sequences: list[list[int]] | np.ndarray, lengths: np.ndarray | None = None,
                 max_depth: int = 24, config: dict | None = None):
        """sequences: a list of token lists, or (with lengths) their tokens end to end."""
        if lengths is None:
            lengths = np.array([len(s) for s in sequences], dtype=np.int64)
            sequences = np.fromiter((t for s in sequences for t in s), dtype=np.uint32, count=int(lengths.sum()))
        flat = np.asarray(sequences, dtype=np.uint32)
        if int(lengths.sum()) != len(flat):
            raise ValueError(f"datastore: lengths sum to {int(lengths.sum())}, tokens are {len(flat)}")
        self.max_depth = max_depth
        self.config = config or {}
        self.num_sequences = len(lengths)
        self.num_tokens = len(flat)
        # forward layout with a separator after each sequence: drafts read it
        seps = np.cumsum(lengths) + np.arange(len(lengths))
        fwd = np.full(len(flat) + len(lengths), SEP, dtype=np.uint32)
        keep = np.ones(len(fwd), dtype=bool)
        keep[seps] = False
        fwd[keep] = flat
        self.fwd = fwd
        self._fwd_list = array.array("I", fwd.tobytes())  # indexed one token at a time: Python ints
        rev = fwd[::-1].copy()  # R: position r of R is position n - 1 - r of fwd
        self._rbuf = rev.astype(">u4").tobytes()
        starts = _sorted_starts(rev, max_depth)
        self._order = array.array("q", starts.tobytes())
        self._end = len(fwd) - 1 - starts  # each one's position in fwd

    @classmethod
    def load(cls, path: str | Path, max_depth: int = 24) -> "Datastore":
        path = Path(path)
        file = path / FILE if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no datastore at {path} (expected {FILE} in a directory)")
        config_file = file.parent / "config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        with np.load(file) as z:
            return cls(z["tokens"], z["lengths"], max_depth=max_depth, config=config)

    def check_vocab(self, vocab_hash: str) -> None:
        """Refuses to draft for a target whose ids mean other tokens (its drafts would all be
        verified away, at a cost every step). Either hash unknown (""): not checked."""
        want = self.config.get("vocab_hash", "")
        if want and vocab_hash and want != vocab_hash:
            raise ValueError(f"the datastore was made with another tokenizer (vocabulary hash {want[:12]}...) "
                             f"than the target's ({vocab_hash[:12]}...)")

    def speculate(self, context: list[int], max_spec_tokens: int, max_spec_factor: float,
                  min_token_prob: float) -> tuple[list[int], float, int]:
        """(draft, score, match_len): the score is the sum of the draft's path probabilities."""
        ctx = context[-(self.max_depth - 1):]
        if not ctx or max_spec_tokens <= 0:
            return [], 0.0, 0
        pattern = np.asarray(ctx[::-1], dtype=">u4").tobytes()
        buf, order = self._rbuf, self._order
        ranges, lo, hi = [], 0, len(order)
        for m in range(1, len(ctx) + 1):
            want = pattern[: 4 * m]
            key = lambda r, n=4 * m: buf[4 * r: 4 * r + n]  # noqa: E731
            lo = bisect.bisect_left(order, want, lo, hi, key=key)
            hi = bisect.bisect_right(order, want, lo, hi, key=key)
            if lo >= hi:
                break
            ranges.append((m, lo, hi))
        for m, lo, hi in reversed(ranges):
            limit = min(max_spec_tokens, int(m * max_spec_factor + 1e-6), self.max_depth - m)
            draft, score = self._follow(lo, hi, limit, min_token_prob)
            if draft:
                return draft, score, m
        return [], 0.0, 0

    def _follow(self, lo: int, hi: int, limit: int, min_token_prob: float) -> tuple[list[int], float]:
        ends = self._end[lo:hi]
        if len(ends) > MODE_SAMPLE:  # an evenly spread sample (the order is deterministic)
            ends = ends[np.linspace(0, len(ends) - 1, MODE_SAMPLE).astype(np.int64)]
        draft, score, prob = [], 0.0, 1.0
        while len(draft) < limit and len(ends):
            # many occurrences: counted in numpy; a few (most steps): in Python, cheaper there
            tok, nxt = self._next_numpy(ends) if len(ends) > 64 else self._next_python(ends)
            if tok is None:
                break
            prob *= len(nxt) / len(ends)
            if prob < min_token_prob:
                break
            draft.append(tok)
            score += prob
            ends = nxt
        return draft, score

    def _next_numpy(self, ends: np.ndarray):
        """The most frequent next token (the newest occurrence breaks ties) and where it is."""
        nxt = self.fwd[ends + 1]
        values, counts = np.unique(nxt[nxt != SEP], return_counts=True)
        if not len(values):
            return None, None
        tied = values[counts == counts.max()]
        tok = int(tied[0]) if len(tied) == 1 else max((int(ends[nxt == v].max()), int(v)) for v in tied)[1]
        return tok, ends[nxt == tok] + 1

    def _next_python(self, ends):
        fwd, groups = self._fwd_list, {}
        for e in (ends.tolist() if isinstance(ends, np.ndarray) else ends):
            tok = fwd[e + 1]
            if tok != SEP:
                groups.setdefault(tok, []).append(e + 1)
        if not groups:
            return None, None
        tok, nxt = max(groups.items(), key=lambda kv: (len(kv[1]), max(kv[1])))
        return tok, nxt
