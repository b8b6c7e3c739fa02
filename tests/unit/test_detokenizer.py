"""Gateway text output: incremental UTF-8 safe detokenization and stop strings with hold-back.

Uses the byte-level BPE tokenizer of the bundled demo target, where most non-ASCII
characters span several tokens, so a naive per-token decode would emit "\ufffd".
"""
from __future__ import annotations

import random

import pytest

from specd.models.demo_paths import demo_model_dir
from specd.models.detokenizer import IncrementalDetokenizer, StopStrings
from specd.models.tokenizer import Tokenizer

TEXTS = ["héllo 世界 🎉", "def f(x):\n    return x  # ünïcödé ✓\n", "🎉🎉🎉 emoji-only 👩‍👩‍👧", "plain ascii"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    t = Tokenizer.from_dir(demo_model_dir("target"))
    if t is None:
        pytest.skip("the bundled demo target is missing")
    return t


def stream(tok: Tokenizer, prompt_ids: list[int], ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt_ids)
    deltas = [detok.add(t) for t in ids] + [detok.flush()]
    assert detok.text == "".join(deltas)
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_join_to_the_full_decode_and_never_split_a_character(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    # The test is only meaningful if some character really spans several tokens.
    if text != "plain ascii":
        assert any("\ufffd" in tok.decode([t]) for t in ids)
    deltas = stream(tok, [], ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_prompt_context_does_not_leak_into_the_output(tok):
    prompt = tok.encode("def add(a, b):\n    return")
    ids = tok.encode(" a + b  # héllo", add_special_tokens=False)
    assert "".join(stream(tok, prompt, ids)) == " a + b  # héllo"


def test_special_tokens_are_skipped(tok):
    ids = tok.encode("ok 世界", add_special_tokens=False) + [1]  # 1 = <|eos|>
    assert "".join(stream(tok, [0], ids)) == "ok 世界"


def test_random_token_streams_match_decode(tok):
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 30))]
        deltas = stream(tok, [], ids)
        assert "".join(deltas) == tok.decode(ids)
        assert not any(d.endswith("\ufffd") for d in deltas[:-1])  # only the final flush may end mid-character


def feed_all(stops: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    s = StopStrings(stops)
    out = []
    for i, piece in enumerate(pieces):
        text, stopped = s.feed(piece, final=i == len(pieces) - 1)
        out.append(text)
        if stopped:
            return out, True
    return out, False


def test_stop_string_split_across_deltas_is_never_partially_emitted():
    out, stopped = feed_all(["world"], ["Hello wo", "rld! more", "tail"])
    assert stopped and "".join(out) == "Hello "
    assert out[0] == "Hell"  # "o wo" held back: it could be the start of "world"


def test_earliest_stop_wins_and_the_rest_is_flushed_at_the_end():
    out, stopped = feed_all(["\n\n", "b"], ["xxab\n\n"])
    assert stopped and "".join(out) == "xxa"
    out, stopped = feed_all(["zz", ""], ["abc", "dz"])
    assert not stopped and out == ["ab", "cdz"]


def test_random_chunkings_cut_exactly_at_the_first_stop():
    rng = random.Random(1)
    for _ in range(300):
        text = "".join(rng.choice("ab世🎉 ") for _ in range(rng.randint(0, 40)))
        stops = ["".join(rng.choice("ab世🎉 ") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(1, 6))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        found = [i for i in (text.find(s) for s in stops) if i >= 0]
        out, stopped = feed_all(stops, pieces)
        assert stopped == bool(found)
        assert "".join(out) == (text[:min(found)] if found else text)
        emitted = ""
        for piece in out:
            emitted += piece
            assert not any(s in emitted for s in stops)


def test_stop_string_on_detokenized_multibyte_text(tok):
    ids = tok.encode("say 世界 twice: 世界", add_special_tokens=False)
    detok, stops = IncrementalDetokenizer(tok, []), StopStrings(["界 t"])
    out = []
    for t in ids:
        text, stopped = stops.feed(detok.add(t), final=False)
        out.append(text)
        if stopped:
            break
    assert stopped and "".join(out) == "say 世"
