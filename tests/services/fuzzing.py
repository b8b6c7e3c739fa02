"""What the fuzz tests (test_fuzz_http.py, test_fuzz_grpc.py) share: their hypothesis settings and
the JSON values they build hostile inputs from.

In CI every property runs a fixed budget (EXAMPLES) with derandomize=True: the examples depend
only on the test's code, so a failure reproduces on every run and machine. A longer run sets
SPECD_FUZZ_EXAMPLES (bench/fuzz.py does): then the examples come from hypothesis' seed, which
bench/fuzz.py chooses, prints and passes as --hypothesis-seed, so a failure found there is
reproduced by running it again with that seed.
"""
from __future__ import annotations

import math
import os

from hypothesis import HealthCheck, Phase, currently_in_test_context, event, settings
from hypothesis import strategies as st

DEFAULT_EXAMPLES = 150
LONG_RUN = "SPECD_FUZZ_EXAMPLES" in os.environ
EXAMPLES = int(os.environ.get("SPECD_FUZZ_EXAMPLES", DEFAULT_EXAMPLES))


def fuzz_settings(share: float = 1.0, **overrides) -> settings:
    """`share` of the budget for this property (the cheaper, narrower ones take less)."""
    return settings(max_examples=max(10, int(EXAMPLES * share)), deadline=None, derandomize=not LONG_RUN,
                    database=None, print_blob=True, suppress_health_check=list(HealthCheck), **overrides)


def find_settings() -> settings:
    """For a property that only has to fail (an error path broken on purpose): ten times the budget,
    as it stops at its first failure (the budget costs nothing while the property works), and no
    shrinking of what it found. With the usual budget a clean CI run once went 150 examples without
    finding what the same examples found here (a negative token id to /detokenize)."""
    return fuzz_settings(share=10, report_multiple_bugs=False,
                         phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target))


def note(what: str) -> None:
    """An entry of hypothesis' statistics (--hypothesis-show-statistics: how a property's examples
    were answered) when in a property."""
    if currently_in_test_context():
        event(what)


# Integers where a bound usually sits: the wire types' limits (int32, uint32, int64, uint64) and past them.
EDGE_INTS = [0, -1, 1, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 53 + 1, 2 ** 63 - 1, 2 ** 63, 2 ** 64,
             -2 ** 31 - 1, -2 ** 63 - 1, 10 ** 30, -10 ** 30]
EDGE_FLOATS = [0.0, -0.0, 1e308, -1e308, 5e-324, 1e-300, 3.4e38, 3.5e38, math.inf, -math.inf, math.nan, 0.5, 2.0]

ints = st.one_of(st.integers(-5, 40), st.sampled_from(EDGE_INTS), st.integers())
floats = st.one_of(st.sampled_from(EDGE_FLOATS), st.floats())  # NaN and infinities included
# Text with what breaks naive handling: control characters, NULs, combining marks, astral characters,
# chat-template markers; huge strings are built by `huge` below, not drawn character by character.
MARKERS = ["<|im_start|>", "<|im_end|>", "</s>", "<s>", "{{", "{%", "\\", "\x00", "\ufeff", "\u202e", "🎉"]
texts = st.one_of(st.text(max_size=24), st.sampled_from(MARKERS), st.text(st.sampled_from("ab \n\t\"'<>{}%|"),
                                                                                max_size=12))


def huge(pieces: st.SearchStrategy, max_repeat: int) -> st.SearchStrategy:
    """A piece repeated up to max_repeat times: big values that cost little to draw."""
    return st.tuples(pieces, st.integers(1, max_repeat)).map(lambda t: t[0] * t[1])


huge_texts = huge(st.sampled_from(["a", "x y ", "é", "🎉", "<|im_end|>", "\\u0000"]), 300_000)
keys = st.one_of(texts, st.sampled_from(["type", "name", "role", "content", "text", "function", "json", "regex",
                                         "choice", "grammar", "schema", "json_schema", "properties"]))
json_leaves = st.one_of(st.none(), st.booleans(), ints, floats, texts)
any_json = st.recursive(json_leaves, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                             st.dictionaries(keys, inner, max_size=4)),
                        max_leaves=12)
