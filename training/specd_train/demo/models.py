"""Architectures of the demo pair: two Llama configs sharing one tokenizer.

Plain transformers LlamaConfig so any Llama-compatible engine loads them. Both use GQA and
head_dim 32; the target has >= 8x the drafter's non-embedding parameters.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()  # keep the training log to our own progress bars

TARGET_NAME = "specd-demo-target"
DRAFTER_NAME = "specd-demo-drafter"
MAX_POSITIONS = 1024


@dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int

    def as_dict(self) -> dict:
        return asdict(self)


TARGET_SIZE = Size(hidden=256, layers=6, heads=8, kv_heads=4, intermediate=704)
# Three narrow layers: a first run with two layers reached only alpha(k=4) = 0.53; depth
# helps agreement more than width, and 3 x 320 keeps the target >= 8x (8.6x).
DRAFTER_SIZE = Size(hidden=128, layers=3, heads=4, kv_heads=2, intermediate=320)
# For the determinism test and smoke runs: seconds, not minutes.
TINY_TARGET_SIZE = Size(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)
TINY_DRAFTER_SIZE = Size(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)


def llama_config(size: Size, vocab_size: int, bos_id: int, eos_id: int, pad_id: int) -> LlamaConfig:
    if size.hidden % size.heads or size.heads % size.kv_heads:
        raise ValueError(f"bad size {size}: hidden % heads and heads % kv_heads must be 0")
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        head_dim=size.hidden // size.heads,
        hidden_act="silu",
        max_position_embeddings=MAX_POSITIONS,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,  # halves the embedding cost of these tiny models
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        initializer_range=0.02,
    )


def build_model(config: LlamaConfig) -> LlamaForCausalLM:
    """A fresh float32 model; callers seed torch first so the init is reproducible."""
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).float()


def param_counts(model: torch.nn.Module) -> dict[str, int]:
    # Tied embeddings are counted once (parameters() deduplicates shared tensors).
    total = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight.numel()
    return {"total": total, "embedding": emb, "non_embedding": total - emb}


def save_model(model: LlamaForCausalLM, out_dir, bos_id: int, eos_id: int, pad_id: int) -> None:
    """Save as bf16 safetensors (what ships); the training copy stays float32."""
    out_dir.mkdir(parents=True, exist_ok=True)
    shipped = LlamaForCausalLM(model.config)
    shipped.load_state_dict(model.state_dict())
    shipped = shipped.to(torch.bfloat16)
    shipped.config.dtype = torch.bfloat16
    shipped.generation_config = GenerationConfig(
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id, do_sample=False,
    )
    shipped.save_pretrained(out_dir, safe_serialization=True)


def load_model(model_dir, device: str = "cpu") -> LlamaForCausalLM:
    """Load shipped bf16 weights and compute in float32 (exact upcast) for evaluation."""
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    return model.to(device).eval()
