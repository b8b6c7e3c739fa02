"""Tiny GGUF files written the way llama.cpp's convert_hf_to_gguf.py writes them (tests/engine/test_gguf.py
says how), for the loader's tests and the serving tests that take a .gguf through every door."""
from __future__ import annotations

import json
from pathlib import Path

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


def hf_model(arch: str, out: Path, vocab_size: int) -> Path:
    cls, _, _, tied = ARCHS[arch]
    cfg = getattr(transformers, cls)(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, rms_norm_eps=1e-6,
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


def permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: interleave each head's rotary halves."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, arch: str, hf_dir: Path, tokenizer, types=None, eos: int = EOS, arch_name=None,
               extra_tensors=()) -> Path:
    """hf_dir (save_pretrained) -> a GGUF laid out as llama.cpp's converter lays it out."""
    from safetensors.numpy import load_file

    tokens, merges = tokenizer
    pre, add_bos = ARCHS[arch][1], ARCHS[arch][2]
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
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 4 if t == USER_DEFINED else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(eos)
    w.add_pad_token_id(BOS)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_chat_template(TEMPLATE)
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
    else:
        w.add_tensor(name, gguf.quants.quantize(v, qtype), raw_dtype=qtype)
