"""Batch-invariant mode (the default): in bfloat16, a token's logits do not depend on what else
the step computes, so greedy speculation gives exactly the plain tokens, in any batch, for every
method (hidden-state heads included), and a seeded sampled request reproduces whatever its batch.

The model is random with near-flat logits, where a last-bit difference flips the argmax often:
the control test makes a forward that is not invariant and shows the same comparison then fails.
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


def _row_count_dependent_mlp(monkeypatch) -> None:
    """A forward that is not batch-invariant, made on purpose (no machine is relied on to have one):
    the MLP's output moves by a few bf16 ulps in steps whose row count is a multiple of 5 (k = 4
    verify blocks), as a kernel that reduces in another order for some row counts would. The layer loop runs (not
    decoder_stack), so the patched MLP is the one computed."""
    from specd.engine.model import decoder as model_module

    real = model_module.MLP.forward

    def forward(self, x):
        y = real(self, x)
        return y if x.shape[0] % 5 else (y.float() * (1 + 2 ** -6)).to(y.dtype)

    monkeypatch.setattr(model_module.MLP, "forward", forward)
    monkeypatch.setattr(model_module.CausalLM, "stack_tensors", lambda self: None)


def test_control_a_forward_that_is_not_invariant_changes_the_tokens(model, drafter, monkeypatch):
    """The comparisons above have teeth: with a non-invariant forward, bf16 speculation changes tokens."""
    _row_count_dependent_mlp(monkeypatch)
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


def test_a_machine_whose_forward_is_not_invariant_turns_the_mode_off(model, monkeypatch, caplog):
    """The load-time self-test runs the real forward: a kernel that changes a row's bits for one row
    count is caught (the check of each matmul shape alone, before it, did not look there), the mode
    turns off with a WARNING naming the layout, and the model says it is not exact."""
    _row_count_dependent_mlp(monkeypatch)
    with caplog.at_level(logging.WARNING):
        llm = _llm(model)
    assert "batch-invariant mode is off" in caplog.text and "5-row verify block" in caplog.text
    assert not llm.engine.model.exact
    assert not any(layer.self_attn.invariant for layer in llm.engine.model.model.layers)


def test_the_default_path_passes_the_self_test(model):
    """Where the fused CPU ops build (x86-64 with AVX-512), the bf16 forward is invariant by construction."""
    from specd.kernels import cpu_ops

    if not cpu_ops.available():
        pytest.skip("the fused CPU ops do not build here: the torch path's exactness is what its self-test says")
    assert _llm(model).engine.model.exact


def test_the_load_says_which_instructions_its_matmul_takes(model, caplog):
    """Each path has its own bits (kernels/cpu_bf16_matmul.cpp), so the load logs the one it took:
    this model's widths, 256 and 768, are multiples of 32, so both take the same one."""
    from matmul_paths import NAMES, expected_path
    from specd.kernels import cpu_ops

    if not cpu_ops.available():
        pytest.skip("the fused CPU ops do not build here")
    with caplog.at_level(logging.INFO, logger="specd.engine.loader"):
        _llm(model)
    line = next(r.getMessage() for r in caplog.records if "bf16 CPU matmul on" in r.getMessage())
    assert line.startswith(f"bf16 CPU matmul on {NAMES[expected_path(256)]} ("), line
