"""suffix (SuffixDecoding) proposer: own-history and global-cache drafts, match-bounded
speculation length, min_token_prob, tree depth, FIFO cache eviction."""
from __future__ import annotations

import random

import pytest

from specd.proposers.base import ProposeRequest
from specd.proposers.suffix import SequenceIndex, SuffixProposer, SuffixTrie


def full(seq_id: int, tokens: list[int], k: int, **kw) -> ProposeRequest:
    return ProposeRequest(seq_id, list(tokens), len(tokens), k, full_history=True, **kw)


def make(**keys) -> SuffixProposer:
    keys.setdefault("num_speculative_tokens", 16)
    return SuffixProposer(**keys)


def draft(p: SuffixProposer, seq_id: int, tokens: list[int], k: int = 8) -> list[int]:
    (prop,) = p.propose([full(seq_id, tokens, k)])
    assert not prop.resync and prop.q_ids is None
    return prop.token_ids


def finish(p: SuffixProposer, seq_id: int, prompt: list[int], response: list[int], cache_output: bool = True) -> None:
    """A whole request: first contact with the prompt, the response committed token by token, release."""
    p.propose([full(seq_id, prompt, 0, cache_output=cache_output)])
    n = len(prompt)
    for tok in response:
        n += 1
        p.propose([ProposeRequest(seq_id, [tok], n, 0)])
    p.release([seq_id])


def test_repeated_pattern_from_own_history():
    p = make()
    body = [10, 11, 12, 13, 14, 15]
    # "10 11 12" seen once before, followed by 13 14 15: match length 3 allows 3 drafts
    assert draft(p, 1, body + [99, 10, 11, 12]) == [13, 14, 15]
    # committed tokens extend the request's trie incrementally
    (prop,) = p.propose([ProposeRequest(1, [13], 11, 8)])
    assert prop.token_ids == [14, 15, 99, 10]


def test_drafts_from_global_cache_of_previous_request():
    p = make()
    finish(p, 1, prompt=[1, 2, 3], response=[50, 51, 52, 53, 54, 55, 56])
    assert 1 not in p.requests and len(p.cached) == 1
    # a different request whose output starts like the cached response
    assert draft(p, 2, [7, 8, 9, 50, 51, 52]) == [53, 54, 55]
    # the cache holds responses only: the previous prompt does not leak in
    assert draft(p, 3, [40, 41, 1, 2]) == []


def test_a_request_can_keep_its_answer_out_of_the_global_cache():
    p = make()
    finish(p, 1, prompt=[1, 2, 3], response=[50, 51, 52, 53, 54, 55, 56], cache_output=False)
    assert 1 not in p.requests and not p.cached
    assert draft(p, 2, [7, 8, 9, 50, 51, 52]) == []
    # it still drafts from answers that others let in
    finish(p, 3, prompt=[1, 2, 3], response=[60, 61, 62, 63, 64, 65])
    (prop,) = p.propose([full(4, [7, 60, 61, 62], 8, cache_output=False)])
    assert prop.token_ids == [63, 64, 65]
    p.release([4])
    assert len(p.cached) == 1


def test_global_cache_disabled_and_fifo_eviction():
    p = make(suffix_decoding_max_cached_requests=0)
    finish(p, 1, [1, 2, 3], [50, 51, 52, 53])
    assert draft(p, 2, [9, 50, 51]) == []

    p = make(suffix_decoding_max_cached_requests=1)
    finish(p, 1, [1], [50, 51, 52, 53])
    assert draft(p, 2, [9, 50, 51]) == [52, 53]
    p.release([2])
    finish(p, 3, [1], [60, 61, 62, 63])  # evicts request 1's response
    assert draft(p, 4, [9, 50, 51]) == []
    assert draft(p, 5, [9, 60, 61]) == [62, 63]
    # eviction removed every trace of the evicted response from the global trie
    assert all(tok in (60, 61, 62, 63, 9) for tok in p.global_trie.root.children)


def test_speculation_length_bounded_by_match_length():
    responses = [[1, 2, 3, 4, 5, 6, 7, 8, 9]]
    for factor, context, expected in [
        (1.0, [100, 3], [4]),            # match "3": 1 token
        (1.0, [100, 2, 3], [4, 5]),      # match "2 3": 2 tokens
        (1.0, [100, 1, 2, 3], [4, 5, 6]),
        (2.0, [100, 3], [4, 5]),         # max_spec_factor 2: twice the match length
        (0.5, [100, 2, 3], [4]),
    ]:
        p = make(suffix_decoding_max_spec_factor=factor)
        for i, r in enumerate(responses):
            finish(p, 1000 + i, [0], r)
        assert draft(p, 1, context, k=8) == expected, (factor, context)
    # and k still caps it
    p = make(suffix_decoding_max_spec_factor=4.0)
    finish(p, 1000, [0], responses[0])
    assert draft(p, 1, [100, 1, 2, 3], k=2) == [4, 5]


def test_min_token_prob_stops_low_probability_continuations():
    # After "5 6" the cache saw 7 three times and 8 once; after "5 6 7", 1 twice and 2 once.
    responses = [[5, 6, 7, 1], [5, 6, 7, 1], [5, 6, 7, 2], [5, 6, 8]]

    def run(min_prob: float) -> list[int]:
        p = make(suffix_decoding_min_token_prob=min_prob, suffix_decoding_max_spec_factor=4.0)
        for i, r in enumerate(responses):
            finish(p, 1000 + i, [0], r)
        return draft(p, 1, [100, 5, 6], k=8)

    assert run(0.1) == [7, 1]    # P(7) = 3/4, P(7 1) = 3/4 * 2/3 = 1/2
    assert run(0.6) == [7]       # 1/2 < 0.6: stop after 7
    assert run(0.8) == []        # 3/4 < 0.8: nothing is likely enough
    assert run(0.0) == [7, 1]    # the path ends with the data


def test_max_tree_depth_bounds_match_plus_drafts():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]
    long = draft(make(suffix_decoding_max_spec_factor=16.0), 1, tokens, k=16)
    assert long == [4, 5, 6, 7, 8, 9, 1, 2, 3]
    for depth in (2, 3, 4, 6):
        got = draft(make(suffix_decoding_max_tree_depth=depth, suffix_decoding_max_spec_factor=16.0), 1,
                    tokens, k=16)
        assert got == long[: depth - 1], depth  # match >= 1 token, so at most depth - 1 drafts


def test_rollback_rebuilds_the_request_trie():
    p = make(suffix_decoding_min_token_prob=0.0)
    assert draft(p, 1, [1, 2, 8, 8, 1, 2]) == [8, 8]
    # the caller rolls committed history back and resends it: 8 8 must be forgotten
    assert draft(p, 1, [1, 2, 7, 1, 2]) == [7, 1]
    (prop,) = p.propose([ProposeRequest(1, [7], 6, 8)])
    assert prop.token_ids == [1, 2, 7]


def test_num_prompt_tokens_marks_what_is_cached():
    p = make()
    p.propose([full(1, [30, 31, 32, 33, 34], 0, num_prompt_tokens=2)])
    p.release([1])  # response = 32 33 34
    assert draft(p, 2, [9, 32, 33]) == [34]
    assert draft(p, 3, [9, 30]) == []


def test_trie_counts_match_occurrences_and_remove_restores_it():
    rng = random.Random(0)
    depth = 5
    trie = SuffixTrie(depth)
    seqs = [[rng.randrange(3) for _ in range(rng.randint(1, 30))] for _ in range(6)]
    for s in seqs:
        trie.extend([], s)

    def occurrences(pattern):
        return sum(1 for s in seqs for i in range(len(s) - len(pattern) + 1) if s[i: i + len(pattern)] == pattern)

    def check():
        assert trie.root.count == sum(len(s) for s in seqs)
        stack = [(trie.root, [])]
        while stack:
            node, path = stack.pop()
            assert len(path) <= depth
            if path:
                assert node.count == occurrences(path) > 0
            if node.children:  # the kept best child is the one a draft must follow
                assert node.best_child()[0] == max(node.children, key=lambda t: (node.children[t].count,
                                                                                 node.children[t].last))
            stack.extend((c, path + [t]) for t, c in node.children.items())

    check()
    for _ in range(3):
        trie.remove(seqs.pop(rng.randrange(len(seqs))))
        check()


def test_a_sequence_index_drafts_what_the_trie_of_its_sequence_drafts():
    """A request's own index (token positions) must answer as a suffix trie of its sequence,
    every step of a growing sequence: the same draft, score and match length."""
    rng = random.Random(1)
    for depth in (1, 2, 6, 24):
        for alphabet in (2, 4, 50):
            trie, open_nodes, index, tokens = SuffixTrie(depth), [], SequenceIndex(depth), []
            for _ in range(300):
                new = [rng.randrange(alphabet) for _ in range(rng.randint(1, 3))]
                open_nodes = trie.extend(open_nodes, new)
                index.extend(new)
                tokens += new
                for k, factor, min_prob in ((8, 1.0, 0.1), (3, 2.0, 0.0), (16, 0.5, 0.4), (24, 4.0, 0.0)):
                    assert index.speculate(k, factor, min_prob) == trie.speculate(tokens, k, factor, min_prob)


def test_bad_options():
    with pytest.raises(ValueError):
        make(suffix_decoding_min_token_prob=1.5)
    with pytest.raises(TypeError, match="suffix_decoding_max_depth"):
        make(suffix_decoding_max_depth=3)
    make(prompt_lookup_min=2)  # another method's key: accepted, unused


def test_the_requests_own_draft_stands_wherever_it_has_one():
    p = make()
    for sid in range(1, 6):  # five cached answers agree on 19 20 21 -> 30 31 32 33
        finish(p, sid, prompt=[sid], response=[19, 20, 21, 30, 31, 32, 33])
    # the request's own history has 20 21 -> 40 41 (score 0.5 + 0.5); the cache's 20 21 -> 30 31
    # scores 2, and after 19 20 21 3: the own draft stands either way
    own_history = [9, 20, 21, 40, 41, 42, 8, 20, 21]
    index = SequenceIndex(24)
    index.extend(own_history)
    own_score = index.speculate(8, 1.0, 0.1)[1]
    assert 2 * own_score < p.global_trie.speculate(own_history[:-2] + [19, 20, 21], 8, 1.0, 0.1)[1]
    assert p.propose([full(99, own_history, 8)])[0].source == "own"
    assert draft(p, 99, own_history) == [40, 41]
    assert draft(p, 100, own_history[:-2] + [19, 20, 21]) == [40, 41]
    # with no draft of its own (the context never recurs in it), the cache's, and it says so
    assert draft(p, 101, [9, 8, 20, 21]) == [30, 31]
    assert p.propose([full(102, [9, 8, 20, 21], 8)])[0].source == "cache"


def test_a_datastore_drafts_where_the_request_has_nothing(tmp_path):
    from specd.config import SpeculativeConfig
    from specd.proposers.datastore import save
    from specd.proposers.factory import make_proposer

    save(tmp_path / "ds", [[60, 61, 62, 63, 64], [5, 60, 61, 62, 63]], {"vocab_hash": ""})
    spec = SpeculativeConfig.parse({"method": "suffix", "num_speculative_tokens": 8,
                                    "suffix_decoding_datastore": str(tmp_path / "ds"),
                                    "suffix_decoding_max_cached_requests": 0})
    p = make_proposer(spec, target_vocab_size=None)
    assert draft(p, 1, [1, 2, 60, 61]) == [62, 63]  # the match's length (2) bounds the draft
    assert draft(p, 2, [1, 2, 3]) == []  # nothing matches
    assert draft(p, 3, [60, 61, 62, 7, 60, 61]) == [62, 7]  # its own history first
    assert make(suffix_decoding_max_cached_requests=0).propose([full(4, [1, 2, 60, 61], 8)])[0].token_ids == []


def test_a_datastore_of_another_vocabulary_is_refused_alone_or_in_combined(tmp_path):
    from specd.config import SpeculativeConfig
    from specd.proposers.datastore import save
    from specd.proposers.factory import make_proposer

    save(tmp_path / "ds", [[1, 2, 3]], {"vocab_hash": "abc"})
    suffix = {"method": "suffix", "suffix_decoding_datastore": str(tmp_path / "ds")}
    for spec in (suffix, {"method": "combined", "members": [{"method": "ngram"}, suffix]}):
        config = SpeculativeConfig.parse(spec)
        make_proposer(config, target_vocab_size=None, target_vocab_hash="abc")
        make_proposer(config, target_vocab_size=None)  # no target to check against: a drafter service
        with pytest.raises(ValueError, match="another tokenizer"):
            make_proposer(config, target_vocab_size=None, target_vocab_hash="def")


def test_a_source_the_request_skips_is_not_asked(tmp_path):
    from specd.proposers.datastore import save

    save(tmp_path / "ds", [[60, 61, 62, 63, 64]], {"vocab_hash": ""})
    p = make(suffix_decoding_datastore=str(tmp_path / "ds"), suffix_decoding_max_cached_requests=0)
    (asked,) = p.propose([full(1, [1, 2, 60, 61], 8)])
    assert asked.token_ids == [62, 63] and asked.source == "datastore"
    (skipped,) = p.propose([full(2, [1, 2, 60, 61], 8, skip_sources=frozenset({"datastore"}))])
    assert skipped.token_ids == []
    (own,) = p.propose([full(3, [60, 61, 62, 5, 60, 61], 8, skip_sources=frozenset({"datastore"}))])
    assert own.token_ids == [62, 5] and own.source == "own"  # the request's own history is always asked
