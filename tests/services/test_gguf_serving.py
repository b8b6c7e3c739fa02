"""A .gguf target through every door: `specd up --target FILE.gguf`, and `specd verifier --model
FILE.gguf` with `specd gateway` beside it. No tokenizer directory exists anywhere (the file holds
its tokenizer and chat template): the gateway takes the verifier's over gRPC. Chat through the
official client must use the file's own template (the prompt's token count) and give the offline
engine's greedy text for the same file. Everything runs with the defaults, so where the fused CPU ops
build the file is served in its own quantized types (specd/engine/model/gguf_weights.py), as offline."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import openai
import pytest

pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf_files import ARCHS, bpe_tokenizer, hf_model, write_gguf  # noqa: E402

MESSAGES = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world, what is 12345?"}],
            [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-serving")
    tokenizer = bpe_tokenizer(ARCHS["llama"][1])
    hf_dir = hf_model("llama", root / "hf", len(tokenizer[0]))
    (root / "file").mkdir()
    with pytest.MonkeyPatch.context() as mp:  # the conversion cache of this test and its processes
        mp.setenv("SPECD_CACHE", str(root / "cache"))
        yield write_gguf(root / "file" / "tiny.gguf", "llama", hf_dir, tokenizer)


@pytest.fixture(scope="module")
def offline(gguf_file):
    """[the quantization summary, then (prompt token count, greedy text) per conversation], from the
    offline engine on the file."""
    from specd import LLM, SamplingParams
    from specd.models.chat import chat_prompt_ids

    from specd.kernels import cpu_ops

    llm = LLM(str(gguf_file), device="cpu")
    # Q8_0, Q4_0 and Q4_1 parts stay quantized; the part of gate_up stored F16 makes that linear bf16
    assert (llm.engine.model.quantization is not None) == cpu_ops.available()
    out = [llm.engine.model.quantization]
    for messages in MESSAGES:
        ids = chat_prompt_ids(llm.tokenizer, messages)
        (o,) = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=12))
        out.append((len(ids), o.text))
    return out


def _chat_like_offline(base_url: str, offline) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    (entry,) = client.models.list().data
    model = entry.id
    assert model == "tiny.gguf"
    # the file's types, as the offline engine summarises them (None where it was dequantized)
    assert entry.model_extra["quantization"] == offline[0]
    for messages, (prompt_tokens, text) in zip(MESSAGES, offline[1:]):
        r = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=12)
        assert r.usage.prompt_tokens == prompt_tokens  # the file's chat template, as offline
        assert r.choices[0].message.content == text


def test_verifier_and_gateway_serve_a_gguf_file(gguf_file, offline, launcher):
    verifier = launcher.start("verifier", "verifier", ["--model", str(gguf_file), "--no-speculation"])
    gateway = launcher.start("gateway", "gateway", ["--verifier", verifier.address], http=True)
    assert not (gguf_file.parent / "tokenizer.json").exists()
    _chat_like_offline(f"http://{gateway.address}/v1", offline)
    _no_float32_copy(gguf_file)


def _no_float32_copy(gguf_file) -> None:
    """Served in its own types, the file's weights were never converted (a 1 GB Q4_K_M file is 6 GB
    of float32): the cache holds its config and tokenizer only."""
    from specd.kernels import cpu_ops

    if cpu_ops.available():
        assert not list((gguf_file.parent.parent / "cache" / "gguf").glob("*/model.safetensors"))


def test_specd_up_serves_a_gguf_file(gguf_file, offline, launcher):
    ports = [launcher.free_port() for _ in range(3)]
    proc = subprocess.Popen([sys.executable, "-m", "specd.cli", "up", "--target", str(gguf_file), "--drafter", "ngram",
                             "--port", str(ports[0]), "--verifier-port", str(ports[1]), "--drafter-port", str(ports[2]),
                             "--metrics-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        line = proc.stdout.readline()  # blocks until the stack is healthy (or it gave up)
        assert "specd is up" in line, f"{line!r}\n{proc.stderr.read()[-3000:] if proc.poll() is not None else ''}"
        _chat_like_offline(f"http://127.0.0.1:{ports[0]}/v1", offline)
        _no_float32_copy(gguf_file)  # (the verifier's drafter pool reads the tokenizer from the cache too)
    finally:
        proc.send_signal(signal.SIGTERM)  # specd up stops its services on SIGTERM (a kill would orphan them)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
