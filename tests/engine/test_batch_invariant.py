"""Batch-invariant mode (the default): in bfloat16, a token's logits do not depend on what else
the step computes, so greedy speculation gives exactly the plain tokens, in any batch, for every
method (hidden-state heads included), and a seeded sampled request reproduces whatever its batch.

The model is random with near-flat logits, where a last-bit difference flips the argmax often:
the control test shows that with the mode off the same comparison does fail.
"""
from __future__ import annotations

import logging

import pytest
import torch

from specd import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def _random_llama(tmp_path_factory, layers: int) -> str:
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=layers,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp(f"bf16-model-{layers}")
    transformers.LlamaForCausalLM(cfg).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return _random_llama(tmp_path_factory, 3)


@pytest.fixture(scope="module")
def drafter(model, tmp_path_factory) -> str:
    m = transformers.AutoModelForCausalLM.from_pretrained(model)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.01 * torch.randn_like(p, generator=torch.Generator().manual_seed(1)))
    out = tmp_path_factory.mktemp("bf16-drafter")
    m.save_pretrained(out)
    return str(out)


def _prompts(n: int = 16) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    # mixed lengths, with repeats so prompt lookup drafts
    return [(torch.randint(3, 512, (5 + 7 * i % 40,), generator=g).tolist() * 2) for i in range(n)]


def _llm(model: str, spec: dict | None = None, invariant: bool = True) -> LLM:
    return LLM(model, dtype="bfloat16", device="cpu", max_model_len=512, speculative_config=spec,
               batch_invariant=invariant)


def _alone(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [llm.generate(p, params)[0].token_ids for p in prompts]


def _batched(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params)]


def _spec(method: str, drafter: str) -> dict:
    # Controller off: it turns speculation down from measured step times, which a loaded machine
    # skews, and the test needs drafts in every step.
    return {"adaptive": False, **{
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
        "suffix": {"method": "suffix", "num_speculative_tokens": 4},
        "draft_model": {"method": "draft_model", "model": drafter, "num_speculative_tokens": 4,
                        "draft_dtype": "bfloat16"}}[method]}


@pytest.fixture(scope="module")
def plain_alone(model) -> list[list[int]]:
    llm = _llm(model)
    assert all(layer.self_attn.invariant for layer in llm.engine.model.model.layers), "the mode did not switch on"
    return _alone(llm, _prompts())


def test_target_alone_gives_the_same_tokens_in_any_batch(model, plain_alone):
    assert _batched(_llm(model), _prompts()) == plain_alone


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model"])
def test_greedy_speculation_is_token_identical_in_bf16(method, model, drafter, plain_alone):
    llm = _llm(model, _spec(method, drafter))
    prompts = _prompts()
    assert _alone(llm, prompts[:6]) == plain_alone[:6]  # batch 1
    outs = llm.generate(prompts, GREEDY)  # one mixed batch of 16
    assert [o.token_ids for o in outs] == plain_alone
    assert sum(o.spec["accepted_tokens"] for o in outs) > 0, "no draft was accepted: the test proves nothing"


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory) -> str:
    """As `model`, with 8 layers: EAGLE-3 reads three of them."""
    return _random_llama(tmp_path_factory, 8)


@pytest.mark.parametrize("layout", ["eagle", "eagle3", "medusa_st", "mlp"])
def test_hidden_state_heads_keep_bf16_greedy_identical(layout, deep_model, tmp_path):
    """Random heads draft badly, but every verify block still holds k + 1 rows: the target's own
    token must come out as in a 1-row step."""
    from head_layouts import write_layout

    hf = transformers.AutoModelForCausalLM.from_pretrained(deep_model)
    method, head_dir, _ = write_layout(layout, tmp_path / layout, hf)
    prompts = _prompts()
    plain = _alone(_llm(deep_model), prompts)
    llm = _llm(deep_model, {"method": method, "model": str(head_dir), "target_model": deep_model,
                            "num_speculative_tokens": 3, "adaptive": False})
    assert _alone(llm, prompts[:4]) == plain[:4]  # batch 1
    outs = llm.generate(prompts, GREEDY)  # one mixed batch of 16
    assert [o.token_ids for o in outs] == plain
    assert sum(o.spec["draft_tokens"] for o in outs) > 0, "the head never drafted: the test proves nothing"


def test_control_without_the_mode_outputs_differ(model, drafter):
    """The comparison above has teeth: with the mode off, bf16 speculation changes tokens here."""
    prompts = _prompts()
    plain = _alone(_llm(model, invariant=False), prompts)
    spec = _batched(_llm(model, _spec("draft_model", drafter), invariant=False), prompts)
    assert spec != plain


def test_seeded_sampling_reproduces_whatever_the_batch(model, drafter):
    llm = _llm(model, _spec("draft_model", drafter))
    prompts = _prompts()
    seeded = [SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, seed=100 + i) for i in range(len(prompts))]
    alone = [llm.generate(p, sp)[0].token_ids for p, sp in zip(prompts[:5], seeded)]
    together = [o.token_ids for o in llm.generate(prompts, seeded)][:5]
    assert together == alone


def test_a_machine_whose_matmul_is_not_invariant_turns_the_mode_off(model, monkeypatch, caplog):
    from specd.engine import linear

    real = linear.PlainLinear.forward

    def row_count_dependent(self, x):  # what a split-K kernel does: results shift with the row count
        return real(self, x) + x.shape[0] * 1e-2

    monkeypatch.setattr(linear, "prepacked_bf16_available", lambda device, dtype: False)
    monkeypatch.setattr(linear.PlainLinear, "forward", row_count_dependent)
    with caplog.at_level(logging.WARNING):
        llm = _llm(model)
    assert "batch-invariant mode is off" in caplog.text
    assert not any(layer.self_attn.invariant for layer in llm.engine.model.model.layers)
