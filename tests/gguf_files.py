"""Tiny GGUF files written the way llama.cpp's convert_hf_to_gguf.py writes them (tests/engine/test_gguf.py
says how), for the loader's tests and the serving tests that take a .gguf through every door."""
from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import gguf
import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType as Q

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: control tokens
USER_DEFINED = "<think>"
BOS, EOS = 0, 2
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
CORPUS = ["Hello world, héllo wörld! 12345 and 67 + 890 = ?", "The quick brown fox jumps over the lazy dog.",
          "日本語のテキスト ünïcödé  tabs\tand\nnewlines", "don't you'll we've I'm it's they're",
          "def f(x):\n    return x * 2  # code"] * 20
# arch -> (transformers config, tokenizer.ggml.pre, add_bos_token (None: key absent), tied)
ARCHS = {"llama": ("LlamaConfig", "smollm", True, False), "qwen2": ("Qwen2Config", "qwen2", None, True)}
# Types transformers' GGUF loader reads too (it is the reference); norms and biases stay F32.
REFERENCE_TYPES = {"token_embd": Q.Q8_0, "attn_q": Q.Q8_0, "attn_k": Q.Q4_0, "attn_v": Q.Q4_1,
                   "attn_output": Q.Q8_0, "ffn_gate": Q.Q4_1, "ffn_up": Q.F16, "ffn_down": Q.BF16, "output": Q.Q8_0}


class Vocab(NamedTuple):
    """A GGUF's tokenizer metadata as llama.cpp's converter writes it (token_type: 1 normal, 3 control,
    4 user-defined)."""
    tokens: list[str]
    merges: list[str]
    types: list[int]
    bos: int
    eos: int
    pre: str
    add_bos: bool | None  # None: the key is absent
    template: str


def tiny_vocab(arch: str, tokenizer: tuple[list[str], list[str]], eos: int = EOS) -> Vocab:
    """bpe_tokenizer's (tokens, merges) with this module's specials, template and arch defaults."""
    tokens, merges = tokenizer
    types = [3 if t in SPECIALS else 4 if t == USER_DEFINED else 1 for t in tokens]
    return Vocab(tokens, merges, types, BOS, eos, ARCHS[arch][1], ARCHS[arch][2], TEMPLATE)


def bpe_tokenizer(pre: str) -> tuple[list[str], list[str]]:
    """A byte-level BPE trained with the pre-tokenizer llama.cpp applies for `pre`: tokens, merges."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if pre == "smollm":  # SmolLM2: single digits, then GPT-2's byte-level split
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False)])
    else:  # qwen2's split regex (transformers' Qwen2 tokenizer), then bytes without GPT-2's regex
        from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.add_tokens([USER_DEFINED])
    saved = json.loads(tok.to_str())
    vocab = dict(saved["model"]["vocab"], **{a["content"]: a["id"] for a in saved["added_tokens"]})
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in saved["model"]["merges"]]
    return tokens, merges


def hf_model(arch: str, out: Path, vocab_size: int, hidden_size: int = 64, intermediate_size: int = 128,
             context: int = 256) -> Path:
    cls, _, _, tied = ARCHS[arch]
    cfg = getattr(transformers, cls)(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=context, initializer_range=0.1, rms_norm_eps=1e-6,
        bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=tied)
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # norms init to 1 and biases to 0: spread them so a miswiring shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    return out


def prompt_logits(llm, ids: list[int]) -> torch.Tensor:
    """The engine's logits for every position of `ids`, prefilled in one step (float32, on the CPU)."""
    from specd.engine.scheduler import ScheduledSeq
    from specd.engine.sequence import Sequence
    from specd.sampling import SamplingParams

    engine = llm.engine
    seq = Sequence(ids, SamplingParams())
    assert engine.block_manager.allocate(seq, len(ids))
    try:
        return engine.runner.run([ScheduledSeq(seq, len(ids), len(ids))]).float().cpu()
    finally:
        engine.block_manager.free(seq)


def permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: interleave each head's rotary halves."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, arch: str, hf_dir: Path, tokenizer, types=None, eos: int = EOS, arch_name=None,
               extra_tensors=()) -> Path:
    """hf_dir (save_pretrained) -> a GGUF laid out as llama.cpp's converter lays it out; tokenizer:
    bpe_tokenizer's (tokens, merges), or a whole Vocab (tests/real_vocabs.py)."""
    from safetensors.numpy import load_file

    vocab = tokenizer if isinstance(tokenizer, Vocab) else tiny_vocab(arch, tokenizer, eos)
    cfg = transformers.AutoConfig.from_pretrained(hf_dir)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA if arch == "llama" else gguf.MODEL_ARCH.QWEN2,
                                     cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), arch_name or arch)
    w.add_name("tiny")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"] if hasattr(cfg, "rope_parameters") else cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    if arch == "llama":
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    w.add_token_merges(vocab.merges)
    w.add_bos_token_id(vocab.bos)
    w.add_eos_token_id(vocab.eos)
    w.add_pad_token_id(vocab.bos)
    if vocab.add_bos is not None:
        w.add_add_bos_token(vocab.add_bos)
    w.add_chat_template(vocab.template)
    types = types or REFERENCE_TYPES
    for i, (hf_name, v) in enumerate(sorted(load_file(str(hf_dir / "model.safetensors")).items())):
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if arch == "llama" and name.endswith("attn_q.weight"):
            v = permute(v, cfg.num_attention_heads, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith("attn_k.weight"):
            v = permute(v, cfg.num_attention_heads, cfg.num_key_value_heads)
        qtype = Q.F32 if v.ndim == 1 else types(i) if callable(types) else types[name.split(".")[-2]]
        add_tensor(w, name, v, qtype)
    for name, v in extra_tensors:
        add_tensor(w, name, v, Q.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def add_tensor(w, name: str, v: np.ndarray, qtype) -> None:
    if qtype in (Q.F32, Q.F16):
        w.add_tensor(name, v.astype(np.float32 if qtype == Q.F32 else np.float16))
    elif qtype in K_QUANTS:
        w.add_tensor(name, K_QUANTS[qtype](v.astype(np.float32)), raw_dtype=qtype)
    elif qtype in (Q.Q2_K, Q.Q3_K):  # no quantizer here: valid blocks of random bits (any bytes decode)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = np.random.default_rng(0).integers(0, 256, (v.shape[0], v.shape[1] // block, size), dtype=np.uint8)
        raw[..., -4:-2] = np.frombuffer(np.float16(1e-3).tobytes(), dtype=np.uint8)  # d, dmin: small weights
        raw[..., -2:] = np.frombuffer(np.float16(1e-3).tobytes(), dtype=np.uint8)
        w.add_tensor(name, raw.reshape(v.shape[0], -1), raw_dtype=qtype)
    else:
        w.add_tensor(name, gguf.quants.quantize(v, qtype), raw_dtype=qtype)


# k-quant writers (the gguf package reads these types but does not write them): simple round-to-nearest
# encoders into llama.cpp's block layouts (ggml-common.h), so a test model holds real k-quant weights.
def _f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).view(np.uint8).reshape(*a.shape, 2)


def _k4_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per block -> the 12 bytes get_scale_min_k4 reads."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    return out


def _k_scale_min(v: np.ndarray, levels: int):
    """v [n, 8, 32] -> (d, dmin, sc, m, q): v ~ d sc q - dmin m with q in [0, levels]."""
    lo, hi = np.minimum(v.min(-1), 0), v.max(-1)
    scale, mins = (hi - lo) / levels, -lo
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (mins.max(-1) / 63).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.nan_to_num(np.clip(np.round(scale / d[:, None]), 0, 63)).astype(np.uint8)
        m = np.nan_to_num(np.clip(np.round(mins / dmin[:, None]), 0, 63)).astype(np.uint8)
        step = d[:, None] * sc
        q = np.nan_to_num(np.round((v + (dmin[:, None] * m)[..., None]) / step[..., None]))
    return d, dmin, sc, m, np.clip(q, 0, levels).astype(np.uint8)


def q4_k(w: np.ndarray) -> np.ndarray:
    rows = w.shape[0]
    v = w.reshape(-1, 8, 32)
    d, dmin, sc, m, q = _k_scale_min(v, 15)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)
    return np.concatenate([_f16(d), _f16(dmin), _k4_scales(sc, m), qs], axis=1).reshape(rows, -1)


def q5_k(w: np.ndarray) -> np.ndarray:
    rows = w.shape[0]
    v = w.reshape(-1, 8, 32)
    d, dmin, sc, m, q = _k_scale_min(v, 31)
    qh = np.zeros((v.shape[0], 32), dtype=np.uint8)
    for j in range(8):
        qh |= ((q[:, j] >> 4) & 1) << j
    low = q & 0xF
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(-1, 128)
    return np.concatenate([_f16(d), _f16(dmin), _k4_scales(sc, m), qh, qs], axis=1).reshape(rows, -1)


def q6_k(w: np.ndarray) -> np.ndarray:
    rows = w.shape[0]
    v = w.reshape(-1, 16, 16)
    scale = np.abs(v).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.nan_to_num(np.clip(np.round(scale / d[:, None]), -128, 127)).astype(np.int8)
        q = np.nan_to_num(np.round(v / (d[:, None] * sc)[..., None]))
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [block, half, quarter, l]
    ql = np.concatenate([q[:, :, 0] & 0xF | (q[:, :, 2] & 0xF) << 4, q[:, :, 1] & 0xF | (q[:, :, 3] & 0xF) << 4],
                        axis=2).reshape(-1, 128)
    qh = (q[:, :, 0] >> 4 | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _f16(d)], axis=1).reshape(rows, -1)


K_QUANTS = {Q.Q4_K: q4_k, Q.Q5_K: q5_k, Q.Q6_K: q6_k}
