"""GGUF checkpoints (llama.cpp's format) -> a Hugging Face model directory.

Weights are dequantized with the `gguf` package to float32, which holds every GGML quant
exactly (scale x int + min, all from fp16 parts), so loading the directory in any dtype
rounds once, exactly as dequantizing straight to that dtype would. The tokenizer, chat
template and special tokens come from the GGUF metadata. Anything we cannot map fails with
an error naming the file and the part.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np

# general.architecture -> HF architecture; llama.cpp permutes Q/K rows of llama-family
# checkpoints for its rotary layout (convert_hf_to_gguf.py), which we undo.
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}
_LAYER_PARTS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_PARTS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
# tokenizer.ggml.pre -> the pre-tokenizer llama.cpp applies for it (llama-vocab.cpp)
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_PRE_TOKENIZERS = {
    "default": [], "gpt2": [],
    "smollm": [{"type": "Digits", "individual_digits": True}],
    "starcoder": [{"type": "Digits", "individual_digits": True}],
    "qwen2": [{"type": "Split", "behavior": "Isolated", "invert": False, "pattern": {"Regex":
              r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"}}],
    "llama-bpe": [{"type": "Split", "behavior": "Isolated", "invert": False, "pattern": {"Regex":
                  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"}}],
}
# Pre-tokenizers that split with their own regex need ByteLevel without GPT-2's regex.
_OWN_REGEX = {"qwen2", "llama-bpe"}
_CONTROL, _USER_DEFINED = 3, 4


class GGUFError(ValueError):
    pass


def find_gguf(path: Path) -> Path | None:
    """The GGUF file a --model argument names: the file itself, or the one file in a directory."""
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            raise GGUFError(f"{path} holds {len(files)} .gguf files ({', '.join(f.name for f in files[:4])}); "
                            "pass the one to load")
        return files[0] if files else None
    return None


def convert_gguf(gguf_path: Path, out_dir: Path, weights: bool = True) -> Path:
    """Write config.json, generation_config.json, model.safetensors (float32; not with weights=False:
    a file served in its own types is read by specd/engine/model/gguf_weights.py), tokenizer.json,
    tokenizer_config.json and chat_template.jinja for `gguf_path` into `out_dir`."""
    import gguf
    from safetensors.numpy import save_file

    reader = _open(gguf_path)
    meta = _Meta(reader, gguf_path)
    config, permute_qk = _config(meta)
    tensors = {}
    names = {_hf_name(t.name, gguf_path) for t in reader.tensors}
    for t in reader.tensors if weights else []:
        name = _hf_name(t.name, gguf_path)
        if name is None:
            continue
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        except NotImplementedError:
            raise GGUFError(f"{gguf_path}: tensor {t.name} has quantization {t.tensor_type.name}, which the gguf "
                            "package cannot dequantize") from None
        w = w.reshape([int(d) for d in reversed(t.shape)]) if w.ndim != len(t.shape) else w
        if permute_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads"] if "q_proj" in name else config["num_key_value_heads"]
            w = _unpermute(w, heads)
        tensors[name] = np.ascontiguousarray(w)
    if "model.embed_tokens.weight" not in names:
        raise GGUFError(f"{gguf_path}: no token_embd.weight tensor")
    config["tie_word_embeddings"] = "lm_head.weight" not in names
    out_dir.mkdir(parents=True, exist_ok=True)
    if weights:
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json",
                {k: v for k, v in (("bos_token_id", config.get("bos_token_id")),
                                   ("eos_token_id", config.get("eos_token_id"))) if v is not None})
    _write_tokenizer(meta, out_dir)
    return out_dir


class TensorInfo(NamedTuple):
    name: str
    tensor_type: int  # GGML type id
    shape: tuple[int, ...]  # GGUF order: the contiguous dimension first
    data_offset: int  # absolute, in the file
    n_bytes: int


def read_header(path: Path) -> tuple[str, list[TensorInfo]]:
    """A GGUF file's general.architecture and tensors (name, type, shape, where), read from its
    header alone: the other metadata values are skipped, not parsed (GGUFReader builds a numpy view per vocabulary entry:
    seconds and ~150 MB for a 49k vocabulary, which loading the weights does not need)."""
    import gguf

    with open(path, "rb") as f:
        data = f.read(16 << 20)  # headers are a few MB; more is read below where one is longer
        pos = 0

        def need(n: int) -> None:
            nonlocal data
            while pos + n > len(data):
                more = f.read(max(n, 16 << 20))
                if not more:
                    raise GGUFError(f"{path}: truncated: the header runs past the end of the file")
                data += more

        def take(fmt: str):
            nonlocal pos
            size = struct.calcsize(fmt)
            need(size)
            value = struct.unpack_from(fmt, data, pos)
            pos += size
            return value if len(value) > 1 else value[0]

        def string() -> str:
            nonlocal pos
            n = take("<Q")
            need(n)
            pos += n
            return data[pos - n:pos].decode("utf-8", "replace")

        sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value types

        def skip(vtype: int) -> None:
            nonlocal pos
            if vtype == 8:
                string()
            elif vtype == 9:
                item, count = take("<IQ")
                if item in sizes:
                    need(count * sizes[item])
                    pos += count * sizes[item]
                else:
                    for _ in range(count):
                        skip(item)
            else:
                need(sizes[vtype])
                pos += sizes[vtype]

        if take("<I") != 0x46554747:  # "GGUF"
            raise GGUFError(f"{path}: not a readable GGUF file (bad magic)")
        _, n_tensors, n_kv = take("<IQQ")
        alignment, architecture = 32, None
        for _ in range(n_kv):
            key, vtype = string(), take("<I")
            if key == "general.alignment":
                alignment = take("<I")
            elif key == "general.architecture" and vtype == 8:
                architecture = string()
            else:
                skip(vtype)
        raw = []
        for _ in range(n_tensors):
            name = string()
            dims = take("<I")
            shape = tuple(int(d) for d in (take(f"<{dims}Q") if dims > 1 else (take("<Q"),)))
            raw.append((name, take("<I"), shape, take("<Q")))
        start = -(-pos // alignment) * alignment
    size = path.stat().st_size
    infos = []
    for name, qtype, shape, offset in raw:
        block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
        n = int(np.prod(shape)) * nbytes // block
        if start + offset + n > size:
            raise GGUFError(f"{path}: truncated: tensor {name} ends at byte {start + offset + n} but the file has "
                            f"{size} bytes")
        infos.append(TensorInfo(name, qtype, shape, start + offset, n))
    if architecture not in ARCHITECTURES:
        raise GGUFError(f"{path}: architecture {architecture!r} is not supported (general.architecture); "
                        f"supported: {', '.join(ARCHITECTURES)}")
    return architecture, infos


def _open(path: Path):
    import gguf

    class Reader(gguf.GGUFReader):
        # GGUFReader reports a cut-short file as a numpy view/reshape error; check the bounds
        # first so the message says truncated and where (header, or which tensor).
        def _get(self, offset, dtype, count=1, *args, **kwargs):
            end = int(offset) + np.dtype(dtype).itemsize * int(count)
            if end > len(self.data):
                raise GGUFError(f"{path}: truncated: the header (metadata and tensor list) runs past the "
                                f"end of the file ({len(self.data)} bytes)")
            return super()._get(offset, dtype, count, *args, **kwargs)

        def _build_tensors(self, start_offs, fields):
            for field in fields:  # parts: name length, name, n_dims, dims, type, offset (gguf_reader.py)
                block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(field.parts[4][0]))]
                end = start_offs + int(field.parts[5][0]) + int(np.prod(field.parts[3])) * size // block
                if end > len(self.data):
                    name = bytes(field.parts[1]).decode("utf-8", "replace")
                    raise GGUFError(f"{path}: truncated: tensor {name} ends at byte {end} but the file has "
                                    f"{len(self.data)} bytes")
            super()._build_tensors(start_offs, fields)

    try:
        return Reader(str(path))
    except GGUFError:
        raise
    except Exception as e:  # not a GGUF, or corrupt: one line naming the file
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


class _Meta:
    def __init__(self, reader, path: Path):
        self.fields, self.path = reader.fields, path

    def get(self, key: str, default=None):
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def need(self, key: str):
        value = self.get(key)
        if value is None:
            raise GGUFError(f"{self.path}: metadata key {key} is missing")
        return value


def _config(meta: _Meta) -> tuple[dict, bool]:
    arch = meta.need("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{meta.path}: architecture {arch!r} is not supported (general.architecture); "
                        f"supported: {', '.join(ARCHITECTURES)}")
    hf_arch, permute_qk = ARCHITECTURES[arch]
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise GGUFError(f"{meta.path}: rope scaling {scaling!r} ({arch}.rope.scaling.type) is not supported")
    heads = int(meta.need(f"{arch}.attention.head_count"))
    hidden = int(meta.need(f"{arch}.embedding_length"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
                   or hidden // heads)
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.need("tokenizer.ggml.tokens"))
    config = {
        "architectures": [hf_arch],
        "model_type": hf_arch.removesuffix("ForCausalLM").lower(),
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(meta.need(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(meta.need(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(meta.need(f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base") or 10000.0),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length") or 2048),
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": "float32",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if arch == "qwen2":
        config["attention_bias"] = True
    return config, permute_qk


def _hf_name(name: str, path: Path) -> str | None:
    if name in _GLOBAL_PARTS:
        return _GLOBAL_PARTS[name]
    if name == "rope_freqs.weight":
        raise GGUFError(f"{path}: tensor rope_freqs.weight (scaled rotary frequencies) is not supported")
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_PARTS:
        return f"model.layers.{parts[1]}.{_LAYER_PARTS[parts[2]]}"
    raise GGUFError(f"{path}: tensor {name} is not supported")


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp interleaves each head's two rotary halves; HF keeps them as halves.
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tokenizer(meta: _Meta, out_dir: Path) -> None:
    kind = meta.need("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"{meta.path}: tokenizer model {kind!r} (tokenizer.ggml.model) is not supported; "
                        "supported: 'gpt2' (byte-level BPE)")
    pre = meta.get("tokenizer.ggml.pre") or "default"
    if pre not in _PRE_TOKENIZERS:
        raise GGUFError(f"{meta.path}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; "
                        f"supported: {', '.join(_PRE_TOKENIZERS)}")
    tokens = list(meta.need("tokenizer.ggml.tokens"))
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [m.split(" ", 1) for m in meta.need("tokenizer.ggml.merges")]
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": types[i] != _CONTROL, "special": types[i] == _CONTROL}
             for i, t in enumerate(tokens) if types[i] in (_CONTROL, _USER_DEFINED)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": pre not in _OWN_REGEX}
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": _PRE_TOKENIZERS[pre] + [byte_level]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": merges},
    }
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[bos_id]  # llama.cpp prepends BOS to every prompt for these models; so do we
        tokenizer["post_processor"] = {"type": "Sequence", "processors": [tokenizer["post_processor"], {
            "type": "TemplateProcessing", "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                                                     {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}]}
    _write_json(out_dir / "tokenizer.json", tokenizer)

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                  "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
                  "model_max_length": int(meta.get(f"{meta.need('general.architecture')}.context_length") or 2048)}
    for key in ("bos", "eos", "unknown", "padding"):
        value = token(key)
        if value is not None:
            tok_config[{"unknown": "unk_token", "padding": "pad_token"}.get(key, f"{key}_token")] = value
    _write_json(out_dir / "tokenizer_config.json", tok_config)
    template = meta.get("tokenizer.chat_template")
    if template:
        (out_dir / "chat_template.jinja").write_text(template)


def _write_json(path: Path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
