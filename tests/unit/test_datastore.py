"""The suffix index's datastore (specd/proposers/datastore.py) against a brute-force reading of
its contract: the longest suffix of the context found in the sequences, then the most frequent
next token among the occurrences still on the path (the latest occurrence on ties), while the
path's probability holds, never across a sequence's end."""
from __future__ import annotations

import random

import pytest

from specd.proposers.datastore import Datastore, save


def reference(seqs, context, k, factor, min_prob, depth):
    ctx = context[-(depth - 1):]
    flat, owner = [], []  # positions over all sequences, each knowing its sequence
    for si, s in enumerate(seqs):
        flat += s
        owner += [si] * len(s)

    def ends_of(pattern):
        m = len(pattern)
        return [i + m - 1 for i in range(len(flat) - m + 1)
                if flat[i:i + m] == pattern and owner[i] == owner[i + m - 1]]

    matches = []
    for m in range(1, len(ctx) + 1):
        ends = ends_of(ctx[len(ctx) - m:])
        if not ends:
            break
        matches.append((m, ends))
    for m, ends in reversed(matches):
        limit = min(k, int(m * factor + 1e-6), depth - m)
        draft, score, prob = [], 0.0, 1.0
        while len(draft) < limit and ends:
            groups = {}
            for e in ends:
                if e + 1 < len(flat) and owner[e + 1] == owner[e]:
                    groups.setdefault(flat[e + 1], []).append(e + 1)
            if not groups:
                break
            tok, nxt = max(groups.items(), key=lambda kv: (len(kv[1]), max(kv[1])))
            prob *= len(nxt) / len(ends)
            if prob < min_prob:
                break
            draft.append(tok)
            score += prob
            ends = nxt
        if draft:
            return draft, score, m
    return [], 0.0, 0


@pytest.mark.parametrize("vocab, n_seqs, seed", [(3, 60, 0), (5, 20, 1), (12, 40, 2)])
def test_drafts_as_the_brute_force_reading(vocab, n_seqs, seed):
    # vocab 3: thousands of occurrences of a short match (the numpy count); 12: a few (the Python one)
    rng = random.Random(seed)
    seqs = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 60))] for _ in range(n_seqs)]
    store = Datastore(seqs, max_depth=8)
    checked = drafted = 0
    for _ in range(300):
        context = rng.choice(seqs)[: rng.randrange(1, 30)] if rng.random() < 0.7 else \
            [rng.randrange(vocab + 1) for _ in range(rng.randrange(1, 12))]
        k, factor, min_prob = rng.choice([1, 3, 8]), rng.choice([0.5, 1.0, 3.0]), rng.choice([0.0, 0.1, 0.4])
        got = store.speculate(context, k, factor, min_prob)
        want = reference(seqs, context, k, factor, min_prob, 8)
        assert got[0] == want[0] and got[2] == want[2] and got[1] == pytest.approx(want[1]), (context, k, factor)
        checked += 1
        drafted += bool(got[0])
    assert drafted > 100  # the cases drew drafts, not only misses


def test_no_draft_crosses_a_sequence_end():
    store = Datastore([[1, 2, 3], [4, 5], [2, 3, 9]])
    assert store.speculate([7, 2], 4, 1.0, 0.0)[0] == [3]
    assert store.speculate([1, 2], 4, 1.0, 0.0)[0] == [3]  # 1 2 3 then the end: not 4
    assert store.speculate([4, 5], 4, 1.0, 0.0)[0] == []  # 5 ends its sequence; 4 5 ... nowhere else
    assert store.speculate([3], 4, 1.0, 0.0)[0] == [9]  # 3 ends one sequence and is followed by 9 in another


def test_saved_and_loaded_it_drafts_the_same(tmp_path):
    rng = random.Random(3)
    seqs = [[rng.randrange(50) for _ in range(rng.randrange(5, 80))] for _ in range(100)]
    save(tmp_path / "ds", seqs, {"vocab_hash": "abc"})
    loaded, built = Datastore.load(tmp_path / "ds"), Datastore(seqs)
    assert loaded.num_sequences == 100 and loaded.num_tokens == sum(map(len, seqs))
    for s in seqs[:30]:
        for cut in (3, 10, 20):
            assert loaded.speculate(s[:cut], 6, 1.0, 0.1) == built.speculate(s[:cut], 6, 1.0, 0.1)


def test_another_vocabulary_is_refused(tmp_path):
    save(tmp_path / "ds", [[1, 2, 3]], {"vocab_hash": "abc"})
    store = Datastore.load(tmp_path / "ds")
    store.check_vocab("abc")
    store.check_vocab("")  # the target's unknown: not checked
    with pytest.raises(ValueError, match="another tokenizer"):
        store.check_vocab("def")
    with pytest.raises(FileNotFoundError, match="no datastore"):
        Datastore.load(tmp_path / "missing")
