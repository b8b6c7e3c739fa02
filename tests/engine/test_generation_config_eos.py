"""generation_config.json's eos_token_id may be a list (Llama 3 and Qwen ship two or three);
every id in it ends generation, as in transformers' generate.

The demo target with a crafted list: first a greedy run that ignores EOS gives the tokens the
model will produce; then two ids from that run are made the EOS list, and generation must
stop at whichever comes first, and at the second one when the first is never produced.
transformers' greedy generate on the same directory is the outside reference.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from specd.models.demo_paths import demo_model_dir
from specd.llm import LLM
from specd.sampling import SamplingParams

SRC = demo_model_dir("target")
pytestmark = pytest.mark.skipif(not (SRC / "config.json").is_file(), reason="the bundled demo target is missing")

PROMPT = "def fibonacci(n):\n    "
MAX_TOKENS = 24


def with_eos_list(root: Path, name: str, eos: list[int]) -> Path:
    """A copy of the demo target whose generation_config.json says eos_token_id: eos
    (config.json keeps its single id: generation_config is what decides, as in transformers)."""
    d = root / name
    shutil.copytree(SRC, d)
    gen = json.loads((d / "generation_config.json").read_text())
    gen["eos_token_id"] = eos
    (d / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return d


def _greedy(model_dir: Path, ignore_eos: bool = False):
    llm = LLM(str(model_dir), dtype="float32")
    (out,) = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=ignore_eos))
    return llm, out


def _hf_greedy(model_dir: Path, prompt_ids: list[int]) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="module")
def reference() -> list[int]:
    """The greedy tokens of the unmodified target, EOS ignored."""
    _, out = _greedy(SRC, ignore_eos=True)
    assert len(out.token_ids) == MAX_TOKENS
    return out.token_ids


def _first_new_tokens(tokens: list[int]) -> list[tuple[int, int]]:
    """(position, token) of each token's first occurrence, in order."""
    seen, firsts = set(), []
    for pos, t in enumerate(tokens):
        if t not in seen:
            seen.add(t)
            firsts.append((pos, t))
    return firsts


@pytest.mark.parametrize("which", ["first", "second"])
def test_every_id_of_an_eos_list_stops_generation(reference, tmp_path, which):
    firsts = [(p, t) for p, t in _first_new_tokens(reference) if p >= 2]
    assert len(firsts) >= 2, f"the reference run repeats too much to pick two ids: {reference}"
    (pos_a, a), (pos_b, b) = firsts[0], firsts[-1]
    assert pos_a < pos_b
    never = next(t for t in range(3, 4096) if t not in reference)
    # "first": [a, b], generation stops at a (position pos_a); "second": [never, b], the
    # first id never comes, so only the second can stop it (position pos_b)
    eos, stop_at = ([a, b], pos_a) if which == "first" else ([never, b], pos_b)
    d = with_eos_list(tmp_path, "model", eos)
    llm, out = _greedy(d)
    assert llm.engine.eos_token_ids == set(eos)
    assert out.finish_reason == "stop"
    assert out.token_ids == reference[: stop_at + 1]  # the EOS token is the last one emitted
    assert out.token_ids == _hf_greedy(d, out.prompt_token_ids)
