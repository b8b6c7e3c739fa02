"""What every deterministic proposer shares: the registry, per-sequence sync from committed
deltas, resync, rollback through full_history, release and TTL release."""
from __future__ import annotations

import pytest

from specd.config import SpeculativeConfig
from specd.proposers import PROPOSERS, ProposeRequest
from specd.proposers.factory import make_proposer

METHODS = ["ngram", "suffix"]
KEYS = {"ngram": dict(prompt_lookup_min=2, prompt_lookup_max=3),
        "suffix": dict(suffix_decoding_min_token_prob=0.0)}
HISTORY = [1, 2, 3, 4, 5, 9, 1, 2, 3]  # both methods draft 4 5 ... after "1 2 3"


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def build(method: str, **extra):
    return PROPOSERS[method](num_speculative_tokens=4, **KEYS[method], **extra)


def full(seq_id, tokens, k=4):
    return ProposeRequest(seq_id, list(tokens), len(tokens), k, full_history=True)


@pytest.mark.parametrize("method", METHODS)
def test_registry_and_factory_build_working_proposers(method):
    p = build(method)
    (prop,) = p.propose([full(1, HISTORY)])
    assert prop.seq_id == 1 and prop.token_ids[:2] == [4, 5] and not prop.resync
    # the engine's factory passes every method's keys from one SpeculativeConfig
    spec = SpeculativeConfig(method=method, num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3)
    p = make_proposer(spec, target_vocab_size=512)
    assert p.propose([full(1, HISTORY, k=8)])[0].token_ids[:2] == [4, 5]
    assert len(p.propose([full(1, HISTORY, k=8)])[0].token_ids) <= 3


@pytest.mark.parametrize("method", METHODS)
def test_unknown_sequence_or_length_mismatch_asks_for_resync(method):
    p = build(method)
    (prop,) = p.propose([ProposeRequest(5, [1, 2], 2, 4)])  # never seen, no full history
    assert prop.resync and prop.token_ids == []
    assert p.propose([full(5, HISTORY)])[0].token_ids[:2] == [4, 5]
    # the verifier thinks there are 12 tokens, the proposer knows 9 + 1
    (prop,) = p.propose([ProposeRequest(5, [4], 12, 4)])
    assert prop.resync and prop.token_ids == []
    # the state was dropped: even a consistent delta now needs the full history first
    assert p.propose([ProposeRequest(5, [4], len(HISTORY) + 1, 4)])[0].resync
    assert not p.propose([full(5, HISTORY + [4])])[0].resync
    # a full history whose num_tokens disagrees with its own length is out of sync too
    assert p.propose([ProposeRequest(5, HISTORY, len(HISTORY) + 1, 4, full_history=True)])[0].resync


@pytest.mark.parametrize("method", METHODS)
def test_batch_keeps_sequences_apart_and_in_order(method):
    p = build(method)
    other = [7, 8, 9, 6, 7, 8]
    props = p.propose([full(2, other), ProposeRequest(3, [1], 1, 4), full(1, HISTORY)])
    assert [q.seq_id for q in props] == [2, 3, 1]
    assert props[0].token_ids[:1] == [9] and props[1].resync and props[2].token_ids[:2] == [4, 5]
    assert all(t not in (4, 5) for t in props[0].token_ids)


@pytest.mark.parametrize("method", METHODS)
def test_rollback_through_shorter_full_history(method):
    p = build(method)
    assert p.propose([full(1, [1, 2, 3, 8, 8, 1, 2, 3])])[0].token_ids[:2] == [8, 8]
    (prop,) = p.propose([full(1, [1, 2, 3, 7, 1, 2, 3])])  # committed history rolled back and replaced
    assert prop.token_ids[:1] == [7] and 8 not in prop.token_ids
    (prop,) = p.propose([ProposeRequest(1, [7], 8, 4)])
    assert not prop.resync and 8 not in prop.token_ids


@pytest.mark.parametrize("method", METHODS)
def test_release_and_ttl(method):
    clock = Clock()
    p = build(method, ttl_seconds=10.0, clock=clock)
    p.propose([full(1, HISTORY), full(2, HISTORY)])
    p.release([1, 42])  # unknown ids are fine
    assert p.propose([ProposeRequest(1, [4], 10, 4)])[0].resync
    clock.now = 8.0
    p.propose([ProposeRequest(2, [4], 10, 4)])  # touches seq 2
    p.propose([full(3, HISTORY)])
    clock.now = 15.0  # seq 3 idle 7 s, seq 2 idle 7 s: both kept
    assert p.release_expired() == []
    clock.now = 18.5
    assert sorted(p.release_expired()) == [2, 3]
    assert p.propose([ProposeRequest(2, [5], 11, 4)])[0].resync
    # propose sweeps expired sequences on its own
    p.propose([full(4, HISTORY)])
    clock.now = 40.0
    assert p.propose([ProposeRequest(4, [4], 10, 4)])[0].resync


def test_ttl_release_moves_suffix_response_into_global_cache():
    clock = Clock()
    p = build("suffix", ttl_seconds=5.0, clock=clock)
    p.propose([full(1, [0, 0], k=0)])
    p.propose([ProposeRequest(1, [60, 61, 62, 63], 6, 0)])
    clock.now = 6.0
    assert p.release_expired() == [1]
    assert p.propose([full(2, [9, 60, 61])])[0].token_ids == [62, 63]


@pytest.mark.parametrize("method", METHODS)
def test_verify_loop_stays_in_sync_and_drafts_hit_repetitive_text(method):
    """The engine's pattern: send committed deltas, verify drafts against a fixed "target"
    stream, commit the accepted prefix plus one token. No resync after first contact, and on
    repetitive text most tokens come from accepted drafts."""
    target = ([3, 1, 4, 1, 5, 9, 2, 6] * 3 + [7, 7]) * 8
    p = build(method)
    committed, sent, steps, resyncs = target[:5], 0, 0, 0
    while len(committed) < len(target):
        req = ProposeRequest(1, committed[sent:], len(committed), 4, full_history=sent == 0)
        sent = len(committed)
        (prop,) = p.propose([req])
        resyncs += prop.resync
        if prop.resync:
            sent = 0
            continue
        pos = len(committed)
        accepted = 0
        for tok in prop.token_ids:
            if pos + accepted < len(target) and target[pos + accepted] == tok:
                accepted += 1
            else:
                break
        committed = target[: min(len(target), pos + accepted + 1)]
        steps += 1
    assert committed == target and resyncs == 0
    assert steps < len(target) / 2.5, steps
