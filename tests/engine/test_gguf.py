"""`--model file.gguf`: GGUF checkpoints converted once into the cache, checked against outside references.

Each GGUF is written here the way llama.cpp's convert_hf_to_gguf.py writes one: from a tiny random
transformers model saved with save_pretrained, tensor names from the gguf package's own name map,
llama's Q/K rows permuted for llama.cpp's rotary layout, matrices quantized with gguf.quants, norms
and biases kept F32, and a byte-level BPE tokenizer (trained here with `tokenizers`) stored as
tokenizer.ggml.* metadata. The references are transformers' own GGUF loader and tokenizer, the
original float weights, and transformers' generate.
"""
from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' GGUF loading needs it

from gguf import GGMLQuantizationType as Q  # noqa: E402

from specd import LLM, SamplingParams  # noqa: E402
from specd.engine.loader import resolve_model_dir  # noqa: E402
from specd.cache import file_sha256  # noqa: E402
from specd.models.gguf_convert import GGUFError  # noqa: E402

from gguf_files import (ARCHS, BOS, EOS, SPECIALS, TEMPLATE, USER_DEFINED, bpe_tokenizer, hf_model,  # noqa: E402
                        prompt_logits, write_gguf)

pytestmark = pytest.mark.timeout(300)

# max |dequantized - original| as a fraction of the tensor's max |w|: half a quantization step, a
# whole one for Q4_0/Q5_0 (their symmetric grid clips the side opposite the block's largest value)
STEP = {Q.Q8_0: 1 / 200, Q.Q4_0: 1 / 7, Q.Q4_1: 1 / 12, Q.Q5_0: 1 / 15, Q.Q5_1: 1 / 24, Q.F16: 1e-3, Q.BF16: 1e-2}
TEXTS = ["Hello world", "héllo wörld 日本語 ✓ 🚀", "12345 + 67 = 12412", "  leading and trailing  ",
         "tabs\tand\nnewlines\r\n\n", "<|im_start|>user\nhi<|im_end|>\n", f"{USER_DEFINED}why</think>",
         "don't I'M they'RE", ""]


@pytest.fixture(scope="module", autouse=True)
def specd_cache(tmp_path_factory):
    """Conversions land in a temp cache, never in ~/.cache/specd."""
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("specd_cache")
        mp.setenv("SPECD_CACHE", str(path))
        yield path


@pytest.fixture(scope="module", params=list(ARCHS))
def tiny(request, tmp_path_factory):
    """One arch: the transformers dir, its GGUF (in a dir of its own), the tokenizer, the converted dir."""
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    tokenizer = bpe_tokenizer(ARCHS[arch][1])
    hf_dir = hf_model(arch, root / "hf", len(tokenizer[0]))
    (root / "gguf").mkdir()
    path = write_gguf(root / "gguf" / "model.gguf", arch, hf_dir, tokenizer)
    return dict(arch=arch, hf_dir=hf_dir, gguf=path, tokenizer=tokenizer, converted=resolve_model_dir(str(path)))


@pytest.fixture(scope="module")
def hf_gguf(tiny):
    """transformers' own GGUF loader on the same file: the outside reference."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny["gguf"].parent), gguf_file=tiny["gguf"].name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(str(tiny["gguf"]), dtype="float32", device="cpu", max_num_seqs=4)


def _greedy(max_tokens: int, ignore_eos: bool = True) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)


PROMPTS = [[5, 17, 99, 250, 31, 8, 77], [200, 3, 3, 141, 60, 12, 300, 44, 9, 18, 222, 101, 7]]


def test_weights_equal_transformers_gguf_loader(tiny, hf_gguf):
    from safetensors.torch import load_file

    ours = load_file(str(tiny["converted"] / "model.safetensors"))
    ref = hf_gguf.state_dict()
    assert set(ours) <= set(ref) and set(ref) - set(ours) <= {"lm_head.weight"}
    for name, tensor in ours.items():
        assert torch.equal(tensor, ref[name]), name


def test_logits_equal_transformers_gguf_loader(llm, hf_gguf):
    for ids in PROMPTS:
        with torch.no_grad():
            ref = hf_gguf(torch.tensor([ids])).logits[0].float()
        torch.testing.assert_close(prompt_logits(llm, ids), ref, rtol=0, atol=1e-5)


def test_greedy_tokens_gguf_equal_converted_dir_and_transformers(tiny, llm, hf_gguf):
    from_dir = LLM(str(tiny["converted"]), dtype="float32", device="cpu", max_num_seqs=4)
    hf_gguf.generation_config.eos_token_id = None  # ignore EOS, as the engine runs below do
    for ids in PROMPTS:
        ours = llm.generate([ids], _greedy(24))[0].token_ids
        with torch.no_grad():
            out = hf_gguf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   do_sample=False, max_new_tokens=24, pad_token_id=BOS)
        assert ours == from_dir.generate([ids], _greedy(24))[0].token_ids
        assert ours == out[0, len(ids):].tolist()
        assert len(set(ours)) > 1  # not one token repeated (tied random embeddings echo a lot)


def test_tokenizer_encodes_like_transformers_gguf_tokenizer(tiny, llm):
    ref = transformers.AutoTokenizer.from_pretrained(str(tiny["gguf"].parent), gguf_file=tiny["gguf"].name)
    for text in TEXTS:
        ids = llm.tokenizer.encode(text)
        assert ids == ref(text)["input_ids"], text
        assert llm.tokenizer.decode(ids, skip_special_tokens=False) == ref.decode(ids), text
    # the special and user-defined tokens stay whole; BOS only where the GGUF asks for it
    ids = llm.tokenizer.encode(f"<|im_start|>{USER_DEFINED}")
    assert ids == [BOS] * bool(ARCHS[tiny["arch"]][2]) + [SPECIALS.index("<|im_start|>"), len(tiny["tokenizer"][0]) - 1]


def test_chat_template_and_eos_come_through(tiny, llm, tmp_path):
    assert llm.tokenizer.chat_template == TEMPLATE
    assert llm.tokenizer.config["eos_token"] == "<|im_end|>"
    assert llm.engine.eos_token_ids == {EOS}
    # A GGUF whose EOS is a token greedy decoding produces: generation stops right there.
    ids = PROMPTS[0]
    free = llm.generate([ids], _greedy(24))[0].token_ids
    stop_at = next(i for i in range(2, len(free)) if free[i] not in free[:i])
    path = write_gguf(tmp_path / "eos.gguf", tiny["arch"], tiny["hf_dir"], tiny["tokenizer"], eos=free[stop_at])
    out = LLM(str(path), dtype="float32", device="cpu", max_num_seqs=4).generate([ids], _greedy(24, False))[0]
    assert out.token_ids == free[:stop_at + 1] and out.finish_reason == "stop"


def test_other_quant_types_dequantize_close_to_the_original(tiny, tmp_path):
    """Every type gguf.quants can write for these shapes, rotated over the matrices: the converted
    weights are the original float weights up to half a quantization step (a wrong unpermute or
    layout is off by the weights' own size)."""
    from safetensors.torch import load_file

    cycle = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.F16, Q.BF16]
    used = {}

    def types(i):
        used[i] = cycle[i % len(cycle)]
        return used[i]

    path = write_gguf(tmp_path / "mixed.gguf", tiny["arch"], tiny["hf_dir"], tiny["tokenizer"], types=types)
    original = load_file(str(tiny["hf_dir"] / "model.safetensors"))
    ours = load_file(str(resolve_model_dir(str(path)) / "model.safetensors"))
    assert set(used.values()) == set(cycle)
    for i, name in enumerate(sorted(original)):
        want = original[name]
        tol = STEP[used[i]] * want.abs().max().item() if i in used else 0.0
        assert (ours[name] - want).abs().max().item() <= tol, (name, used.get(i))


# ------------------------------------------------------------------ cache


def test_conversion_is_cached_in_specd_cache(tiny, tmp_path, monkeypatch):
    import specd.engine.loader as loader

    monkeypatch.setenv("SPECD_CACHE", str(tmp_path / "cache"))
    out = resolve_model_dir(str(tiny["gguf"]))
    assert out == tmp_path / "cache" / "gguf" / file_sha256(tiny["gguf"])[:16]
    mtime = (out / "model.safetensors").stat().st_mtime_ns

    def no_reconvert(*_):
        raise AssertionError("converted again")

    monkeypatch.setattr(loader, "convert_gguf", no_reconvert)
    assert resolve_model_dir(str(tiny["gguf"])) == out
    assert resolve_model_dir(str(tiny["gguf"].parent)) == out  # a directory holding one .gguf
    renamed = shutil.copy(tiny["gguf"], tmp_path / "renamed.gguf")  # keyed by content, not name
    assert resolve_model_dir(str(renamed)) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime
    assert os.listdir(out.parent) == [out.name]  # no temp dirs left beside it


def test_a_crash_mid_conversion_leaves_nothing(tiny, tmp_path, monkeypatch):
    import specd.engine.loader as loader

    def crash(gguf_path, out_dir, weights=True):
        (out_dir / "config.json").write_text("{}")  # half written
        raise KeyboardInterrupt

    monkeypatch.setenv("SPECD_CACHE", str(tmp_path))
    monkeypatch.setattr(loader, "convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        resolve_model_dir(str(tiny["gguf"]))
    assert os.listdir(tmp_path / "gguf") == []


# ------------------------------------------------------------------ errors


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory):
    """case -> (path, substrings the message must hold: the file and the part)."""
    root = tmp_path_factory.mktemp("bad")
    tokenizer = bpe_tokenizer("smollm")
    hf_dir = hf_model("llama", root / "hf", len(tokenizer[0]))
    good = write_gguf(root / "good.gguf", "llama", hf_dir, tokenizer)
    for d in ("two", "empty"):
        (root / d).mkdir()
    shutil.copy(good, root / "two" / "a.gguf")
    shutil.copy(good, root / "two" / "b.gguf")
    data = good.read_bytes()
    (root / "truncated.gguf").write_bytes(data[:len(data) // 2])
    (root / "header_cut.gguf").write_bytes(data[:100])
    return {
        "phi3": (write_gguf(root / "phi3.gguf", "llama", hf_dir, tokenizer, arch_name="phi3"),
                 ["'phi3'", "general.architecture"]),
        "gpt2": (write_gguf(root / "gpt2.gguf", "llama", hf_dir, tokenizer, arch_name="gpt2"),
                 ["'gpt2'", "general.architecture"]),
        "unknown_tensor": (write_gguf(root / "extra.gguf", "llama", hf_dir, tokenizer,
                                      extra_tensors=[("blk.0.attn_bogus.weight", np.ones(64, np.float32))]),
                           ["tensor blk.0.attn_bogus.weight"]),
        "two_ggufs": (root / "two", ["2 .gguf files", "a.gguf", "b.gguf"]),
        "truncated": (root / "truncated.gguf", ["truncated", "tensor blk."]),
        "header_cut": (root / "header_cut.gguf", ["truncated", "header"]),
    }


@pytest.mark.parametrize("case", ["phi3", "gpt2", "unknown_tensor", "two_ggufs", "truncated", "header_cut"])
def test_unsupported_gguf_names_the_file_and_the_part(bad_models, case, capsys, tmp_path, monkeypatch):
    from specd.cli import main

    monkeypatch.setenv("SPECD_CACHE", str(tmp_path))
    path, parts = bad_models[case]
    with pytest.raises(GGUFError) as exc:
        resolve_model_dir(str(path))
    for part in [str(path)] + parts:
        assert part in str(exc.value)
    assert "\n" not in str(exc.value)
    assert not (tmp_path / "gguf").exists() or os.listdir(tmp_path / "gguf") == []  # nothing half-converted
    capsys.readouterr()
    assert main(["generate", "--model", str(path), "--prompt", "hi"]) != 0
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error:") and parts[0] in err


def test_cli_prints_one_error_line_for_a_bad_gguf(bad_models, specd_cli, cli_env, tmp_path):
    path, parts = bad_models["phi3"]
    env = dict(cli_env, SPECD_CACHE=str(tmp_path))
    proc = subprocess.run(specd_cli + ["generate", "--model", str(path), "--prompt", "hi"],
                          capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode != 0 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    assert str(path) in lines[0] and parts[0] in lines[0]
