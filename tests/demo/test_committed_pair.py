"""The committed pair loads with plain transformers offline and backs its card's numbers."""

from __future__ import annotations

import platform

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specd_train.demo import evaluate
from specd_train.demo.corpus import load_corpus, read_text
from specd_train.demo.models import DRAFTER_NAME, TARGET_NAME
from specd_train.demo.pipeline import spec_from_report
from specd_train.demo.tokenizer import load_tokenizer


@pytest.mark.parametrize("name", [TARGET_NAME, DRAFTER_NAME])
def test_transformers_loads_offline(models_dir, name):
    path = models_dir / name
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    assert model.config.model_type == "llama"
    assert model.dtype == torch.bfloat16  # shipped precision
    ids = tok("def ", return_tensors="pt").input_ids
    assert ids[0, 0].item() == tok.bos_token_id  # BOS added, as the tokenizers library does
    assert ids[0].tolist() == load_tokenizer(path).encode("def ").ids
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_target_continues_def(models_dir):
    path = models_dir / TARGET_NAME
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    ids = tok("def ", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=16, do_sample=False)
    text = tok.decode(out[0], skip_special_tokens=True)
    assert text.startswith("def ") and len(text.strip()) > len("def")


@pytest.fixture(scope="module")
def heldout(report, models_dir):
    if report["data"]["python"] != platform.python_version():
        pytest.skip(f"card measured on Python {report['data']['python']}'s stdlib, "
                    f"this is {platform.python_version()}: held-out files differ")
    tok = load_tokenizer(models_dir / TARGET_NAME)
    return evaluate.token_stream(tok, [read_text(p) for p in load_corpus().heldout])


def test_acceptance_reproduces_card(pair, report, heldout):
    target, drafter = pair
    spec = spec_from_report(report)
    prompts = evaluate.prompts_from(heldout, spec.eval_prompts, spec.eval_prompt_len)
    got = evaluate.acceptance_table(target, drafter, prompts[:: spec.slice_stride],
                                    spec.eval_gen_len, ks=[4])[4].alpha
    # Same prompts and weights: only float noise in near-tied argmaxes can move it.
    assert got == pytest.approx(report["eval"]["alpha_k4_slice"], abs=0.02)
    # And the slice stands for the full figure quoted in the card.
    assert got == pytest.approx(report["eval"]["alpha_k4"], abs=0.1)


# "Clearly below": at least 0.1 nats/token, i.e. the drafter's perplexity >= 10% higher.
CLEAR_GAP = 0.1


def test_target_loss_clearly_below_drafter(pair, report, heldout):
    target, drafter = pair
    windows = evaluate.loss_windows(heldout, report["spec"]["context"], max_windows=16)
    t_loss, d_loss = evaluate.heldout_loss(target, windows), evaluate.heldout_loss(drafter, windows)
    assert d_loss - t_loss >= CLEAR_GAP
    assert report["eval"]["drafter_loss"] - report["eval"]["target_loss"] >= CLEAR_GAP
