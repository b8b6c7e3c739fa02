"""Logits of our paged, ragged forward == transformers' forward (float32, <= 1e-4).

Sequences span several KV blocks (block_size 4) and are fed in chunks of different
sizes in the same forward (prefill chunks next to single-token "decode" chunks),
so the slot mapping, block tables, masks and positions are all exercised.
"""
from __future__ import annotations

import pytest
import torch

from specd.config import EngineConfig
from specd.engine.llm_engine import LLMEngine
from specd.engine.scheduler import ScheduledSeq
from specd.engine.sequence import Sequence
from specd.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

BASE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
            intermediate_size=96, vocab_size=300, max_position_embeddings=256)
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "llama_tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    "llama3_rope": ("LlamaConfig", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 32}}),
    "llama_linear_rope": ("LlamaConfig", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "mistral_sliding": ("MistralConfig", {"sliding_window": 12}),
}
CHUNKS = [(16, 7, 1, 13), (5, 9, 64, 1)]  # per-sequence chunk sizes, one schedule per row


def _make_model(tmp_path_factory, family: str):
    cls_name, extra = FAMILIES[family]
    cfg = getattr(transformers, cls_name)(**BASE, **extra)
    torch.manual_seed(hash(family) % 1000)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08)  # larger than init: logits far from uniform, so errors show
    path = tmp_path_factory.mktemp(family)
    model.save_pretrained(path)
    return path, model.eval()


def _paged_logits(engine: LLMEngine, prompts: list[list[int]], chunks: tuple[int, ...]) -> list[torch.Tensor]:
    seqs = [Sequence(p, SamplingParams()) for p in prompts]
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    while any(s.num_uncomputed_tokens for s in seqs):
        batch = []
        for s, c in zip(seqs, chunks):
            n = min(c, s.num_uncomputed_tokens)
            if n:
                assert engine.block_manager.allocate(s, s.num_computed_tokens + n)
                batch.append(ScheduledSeq(s, n, n))  # logits at every new position
        logits = engine.runner.run(batch)
        for entry, part in zip(batch, logits.split([e.num_new_tokens for e in batch])):
            out[seqs.index(entry.seq)].append(part)
            entry.seq.num_computed_tokens += entry.num_new_tokens
    for s in seqs:
        engine.block_manager.free(s)
    return [torch.cat(parts) for parts in out]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(tmp_path_factory, family):
    path, hf = _make_model(tmp_path_factory, family)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", block_size=4, num_kv_blocks=200))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, BASE["vocab_size"], (n,), generator=g).tolist() for n in (37, 50, 9, 70)]
    for chunks in CHUNKS:
        ours = _paged_logits(engine, prompts, chunks)
        for prompt, got in zip(prompts, ours):
            with torch.no_grad():
                ref = hf(torch.tensor([prompt])).logits[0].float()
            assert got.shape == ref.shape
            diff = (got - ref).abs().max().item()
            assert diff <= 1e-4, f"{family} chunks={chunks} len={len(prompt)}: max abs diff {diff:.2e}"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_loads_and_tracks_transformers(tmp_path_factory, dtype):
    """Half-precision weights run end to end and stay close to transformers in the same dtype."""
    path, hf = _make_model(tmp_path_factory, "qwen3")
    torch_dtype = getattr(torch, dtype)
    engine = LLMEngine(EngineConfig(model=str(path), dtype=dtype, device="cpu", block_size=4, num_kv_blocks=64))
    assert engine.model.model.embed_tokens.weight.dtype == torch_dtype
    prompt = list(range(3, 40))
    (ours,) = _paged_logits(engine, [prompt], (11,))
    with torch.no_grad():
        ref = hf.to(torch_dtype)(torch.tensor([prompt])).logits[0].float()
    scale = ref.abs().max().item()
    assert (ours - ref).abs().max().item() <= 0.03 * scale
