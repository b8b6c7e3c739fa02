"""Models with the hard parts of the ones users bring: real tokenizers and real chat templates,
random weights of a small shape.

No model can be downloaded here, but llama.cpp ships the real vocabularies of the model families it
tests (models/ggml-vocab-*.gguf: tokens, merges, token types) and their published chat templates
(models/templates/*.jinja). Both come inside the llama-cpp-python sdist on PyPI, fetched once at a
pinned version and checked by sha256. From them:
- qwen25: Qwen2.5-Instruct's tokenizer: the qwen2 vocabulary (151,936 entries) with the added tokens
  Qwen2.5 puts at 151646-151664 (<tool_call> and </tool_call> are single user-defined tokens, as in
  its tokenizer_config.json) and its own chat template with tools (Hermes-style calls).
- llama31: Llama 3's vocabulary (128,256) with 3.1's names for its reserved ids (<|eom_id|>,
  <|python_tag|>) and Llama-3.1-8B-Instruct's template (JSON calls).
- wide: the qwen25 tokenizer grown to 262,144 entries (a Gemma-class vocabulary) by merges of
  its own tokens: a valid byte-level BPE whose tokenizer.json is about 20 MB.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import gguf

from gguf_files import Vocab
from specd.cache import file_sha256

SDIST = "llama_cpp_python-0.3.36.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
_MODELS = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/"
FILES = ["ggml-vocab-qwen2.gguf", "ggml-vocab-llama-bpe.gguf", "templates/Qwen-Qwen2.5-7B-Instruct.jinja",
         "templates/meta-llama-Llama-3.1-8B-Instruct.jinja"]
CONTROL, USER_DEFINED = 3, 4

# Qwen2.5-Instruct's added tokens from id 151646 (tokenizer_config.json's added_tokens_decoder):
# (content, special). Not special: llama.cpp's converter writes them as user-defined tokens.
QWEN25_ADDED = [("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
                ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
                ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
                ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
                ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
                ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
                ("<|file_sep|>", False)]
QWEN25_IM_END = 151645
# Llama 3.1 renamed three of Llama 3's reserved ids.
LLAMA31_NAMES = {128004: "<|finetune_right_pad_id|>", 128008: "<|eom_id|>", 128010: "<|python_tag|>"}
LLAMA31_EOT = 128009
WIDE_VOCAB = 262144


def data_dir() -> Path:
    """The extracted files (downloaded once into $SPECD_TEST_DATA, default ~/.cache/specd-test-data)."""
    root = Path(os.environ.get("SPECD_TEST_DATA") or Path.home() / ".cache" / "specd-test-data")
    out = root / "llama.cpp-models"
    if all((out / f).is_file() for f in FILES):
        return out
    sdist = root / SDIST
    if not sdist.is_file() or file_sha256(sdist) != SDIST_SHA256:
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        "-d", str(root), "llama-cpp-python==0.3.36"], check=True)
        if file_sha256(sdist) != SDIST_SHA256:
            raise RuntimeError(f"{sdist}: sha256 is not the pinned {SDIST_SHA256}")
    with tarfile.open(sdist) as tar:
        for f in FILES:
            member = tar.getmember(_MODELS + f)
            member.name = f
            tar.extract(member, out, filter="data")
    return out


def _read(name: str) -> tuple[list[str], list[str], list[int], int, int]:
    r = gguf.GGUFReader(data_dir() / name)

    def strings(key):
        f = r.fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    types = r.fields["tokenizer.ggml.token_type"]
    return (strings("tokenizer.ggml.tokens"), strings("tokenizer.ggml.merges"),
            [int(types.parts[i][0]) for i in types.data],
            int(r.fields["tokenizer.ggml.bos_token_id"].contents()), int(r.fields["tokenizer.ggml.eos_token_id"].contents()))


def qwen25() -> Vocab:
    tokens, merges, types, bos, _ = _read("ggml-vocab-qwen2.gguf")
    for i, (content, special) in enumerate(QWEN25_ADDED, start=151646):
        tokens[i], types[i] = content, CONTROL if special else USER_DEFINED
    template = (data_dir() / "templates/Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    return Vocab(tokens, merges, types, bos, QWEN25_IM_END, "qwen2", False, template)


def llama31() -> Vocab:
    tokens, merges, types, bos, _ = _read("ggml-vocab-llama-bpe.gguf")
    for i, name in LLAMA31_NAMES.items():
        tokens[i] = name
    template = (data_dir() / "templates/meta-llama-Llama-3.1-8B-Instruct.jinja").read_text()
    return Vocab(tokens, merges, types, bos, LLAMA31_EOT, "llama-bpe", True, template)


def wide(size: int = WIDE_VOCAB) -> Vocab:
    """qwen25 with BPE tokens appended up to `size`: each new token is two earlier letter-only
    tokens joined, added with the merge that makes it (lowest priority, so earlier merges keep
    their order and the first 151,936 ids tokenize as before)."""
    base = qwen25()
    tokens, merges, types = list(base.tokens), list(base.merges), list(base.types)
    known = set(tokens)
    words = [t for t in tokens[:151643] if t.isalpha() and t.isascii() and len(t) >= 3][:2000]
    added = []
    for a in words:
        for b in words:
            if len(tokens) + len(added) >= size:
                break
            if a + b not in known:
                known.add(a + b)
                added.append(a + b)
                merges.append(f"{a} {b}")
    # appended after all 151,936 ids: Qwen2.5's own tokens keep their ids
    tokens += added
    types += [1] * len(added)
    if len(tokens) != size:
        raise RuntimeError(f"built {len(tokens)} tokens, wanted {size}")
    return base._replace(tokens=tokens, merges=merges, types=types)


def write_model(vocab: Vocab, arch: str, out: Path, context: int = 32768) -> Path:
    """A random-weight GGUF of a small shape with `vocab` (Q8_0 and Q4 parts, as tests/gguf_files.py
    writes them) and a real model's context length: out/model.gguf, built once."""
    from gguf_files import hf_model, write_gguf

    path = out / "model.gguf"
    if not path.is_file():
        hf_dir = hf_model(arch, out / "hf", len(vocab.tokens), context=context)
        write_gguf(path, arch, hf_dir, vocab)
    return path
