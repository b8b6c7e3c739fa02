"""Stop strings in the engine: generation ends at the token that completes one (it counts,
nothing after it does), with and without speculation; the offline text stops before the string."""
from __future__ import annotations

import json

import pytest

from specd.models.demo_paths import demo_model_dir
from specd.sampling import SamplingParams
from specd.models.tokenizer import Tokenizer

TARGET = str(demo_model_dir("target"))
PROMPT = "def fibonacci(n):\n    "


@pytest.fixture(scope="module")
def reference(get_llm):
    (out,) = get_llm(TARGET).generate([PROMPT], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    return out


def stop_cases(tok: Tokenizer, ids: list[int]) -> list[tuple[str, int]]:
    """(stop string, index of the token that completes it) for strings that start mid-text and
    end inside a token, at a token boundary, and span several tokens."""
    texts = [tok.decode(ids[:i + 1]) for i in range(len(ids))]
    full = texts[-1]
    cases = []
    for start, length in ((len(full) // 3, 3), (len(full) // 2, 1), (len(full) // 4, 12)):
        stop = full[start:start + length]
        first = full.find(stop)
        done = next(i for i, t in enumerate(texts) if stop in t)
        cases.append((stop, done, first))
    return cases


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_speculative_tokens": 4,
                                                "prompt_lookup_min": 1}])
def test_generation_ends_at_the_token_completing_a_stop_string(get_llm, reference, speculative):
    tok = Tokenizer.from_dir(TARGET)
    llm = get_llm(TARGET, speculative_config=json.dumps(speculative)) if speculative else get_llm(TARGET)
    drafted = 0
    for stop, done, first in stop_cases(tok, reference.token_ids):
        params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, stop=["never appears", stop],
                                num_speculative_tokens=4 if speculative else None)
        (out,) = llm.generate([PROMPT], params)
        assert out.finish_reason == "stop", stop
        assert out.token_ids == reference.token_ids[:done + 1], (stop, done, len(out.token_ids))
        assert out.text == reference.text[:first]
        drafted += out.spec["draft_tokens"] if speculative else 0
    assert drafted > 0 or not speculative  # speculating: stops can land inside accepted drafts


def test_stop_strings_are_validated():
    for bad in ([5], ["x"] * 65, ["y" * 1025]):
        with pytest.raises(ValueError, match="stop"):
            SamplingParams(stop=bad)
    assert SamplingParams(stop="x").stop == ["x"] and SamplingParams(stop=["", "a"]).stop == ["a"]
