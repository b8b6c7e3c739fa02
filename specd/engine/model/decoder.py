"""One Llama-family decoder: Llama 2/3, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm).

Projections are fused (qkv, gate_up) so a step issues few, larger matmuls; the
loader splits checkpoint tensors into the fused parameters.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from specd.engine.model.attention import AttentionMetadata, paged_attention, write_kv
from specd.engine.model.config import ModelArchConfig
from specd.engine.model.linear import InvariantCpuLinear, adopt_linears, fast_linear
from specd.engine.model.quant import QuantLinear
from specd.engine.model.rotary import RotaryEmbedding, apply_rotary


log = logging.getLogger(__name__)
# Batch-invariant mode on the torch path computes at most this many rows per matmul call (linear._by_rows).
INVARIANT_MAX_ROWS = 128
# Outside batch-invariant mode, steps with longer queries (prefill) attend through SDPA.
FUSED_ATTENTION_MAX_QUERY = 16


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = False  # kernels/cpu_bf16_ops.cpp (CausalLM.prepare)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return torch.ops.specd_cpu.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:  # one fused op; same arithmetic order as below
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Normalise in float32 and cast back before the weight, as transformers does.
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * y.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, window: int | None):
        super().__init__()
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.window, self.scale = window, self.d**-0.5
        self.invariant = False  # batch-invariant attention (CausalLM.prepare)
        self.fused = False  # kernels/cpu_bf16_ops.cpp (CausalLM.prepare)
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.h + 2 * self.hkv) * self.d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x, cos_sin, kv_cache, meta: AttentionMetadata):
        T = x.shape[0]
        qkv = self.qkv_proj.forward(x).view(T, self.h + 2 * self.hkv, self.d)
        if self.fused and self.q_norm is None and meta.token_seq is not None:
            return self.o_proj.forward(self._fused_attention(qkv, cos_sin, kv_cache, meta).view(T, self.h * self.d))
        qk, v = qkv[:, : self.h + self.hkv], qkv[:, self.h + self.hkv:]
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm.forward(qk[:, : self.h]), self.k_norm.forward(qk[:, self.h:])], dim=1)
        # q and k rotated in one call: half the elementwise ops of rotating them apart.
        qk = apply_rotary(qk, *cos_sin)
        q, k = qk[:, : self.h], qk[:, self.h:]
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, meta, self.scale, self.window, self.invariant)
        return self.o_proj.forward(out.reshape(T, self.h * self.d))

    def _fused_attention(self, qkv, cos_sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """Rotary, KV write and paged attention as two fused CPU ops (same math as above, read
        from the cache in place). Outside batch-invariant mode long prefills keep SDPA, which
        is faster there; the fused op is exact whatever the step holds."""
        k_cache, v_cache = kv_cache
        q = torch.ops.specd_cpu.rotary_write_kv(qkv, self.h, *cos_sin, k_cache, v_cache, meta.slot_mapping)
        if not self.fused_attention_applies(meta):
            return paged_attention(q, k_cache, v_cache, meta, self.scale, self.window, False)
        return torch.ops.specd_cpu.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.token_seq,
                                                   meta.token_pos, self.key_index(meta), self.scale, self.window or 0)

    def fused_attention_applies(self, meta: AttentionMetadata) -> bool:
        return self.invariant or meta.max_query_len <= FUSED_ATTENTION_MAX_QUERY

    def key_index(self, meta: AttentionMetadata) -> torch.Tensor | None:
        """Tree steps: each row's keys in the order a plain decode would see them (the fused op's
        key_index); None otherwise."""
        if meta.tree_base is None:
            return None
        rows = meta.compact_keys(self.window)[0].flatten(0, 1)  # [B * Q, C]
        return rows if meta.query_index is None else rows.index_select(0, meta.query_index)


class MLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.fused = False  # kernels/cpu_bf16_ops.cpp (CausalLM.prepare)

    def forward(self, x):
        if self.fused:
            return self.down_proj.forward(torch.ops.specd_cpu.silu_mul(self.gate_up_proj.forward(x)))
        gate, up = self.gate_up_proj.forward(x).chunk(2, dim=-1)
        return self.down_proj.forward(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, window: int | None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    # Submodules are called through .forward: nn.Module.__call__ costs microseconds
    # per call, which adds up at batch-1 decode on CPU.
    def forward(self, x, cos_sin, kv_cache, meta):
        x = x + self.self_attn.forward(self.input_layernorm.forward(x), cos_sin, kv_cache, meta)
        return x + self.mlp.forward(self.post_attention_layernorm.forward(x))

    def forward_fused(self, x, y, cos_sin, kv_cache, meta):
        """With the fused CPU ops: x the residual stream, y = input_layernorm(x) -> (the stream after
        attention, the MLP's output), left unadded: the next layer adds them inside its norm op."""
        a = self.self_attn.forward(y, cos_sin, kv_cache, meta)
        x, y = torch.ops.specd_cpu.add_rms_norm(a, x, self.post_attention_layernorm.weight,
                                                self.post_attention_layernorm.eps)
        return x, self.mlp.forward(y)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelArchConfig):
        super().__init__()
        # Built on the meta device and then loaded: given a weight, nn.Embedding skips its random
        # init, whose meta path imports torch._dynamo and with it Triton (~65 MB resident, ~1 s).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        windows = cfg.sliding_windows or [None] * cfg.num_layers
        self.layers = nn.ModuleList(DecoderLayer(cfg, windows[i]) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelArchConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        # A drafter may score only a subset of the vocabulary (draft_vocab.json): its head is
        # then those rows, and every other id gets -inf, so it is never drafted.
        self.head_ids: torch.Tensor | None = None  # [V_d]
        self.head: nn.Module | None = None  # hidden -> logits, built by prepare()
        self.fingerprint = ""  # of the loaded weights (specd/engine/model/fingerprint.py), set by the loader
        # A GGUF file's matmul types where they stay quantized (specd/engine/model/gguf_weights.py), e.g.
        # "Q8_0 100%"; None for float weights.
        self.quantization: str | None = None
        # Batch-invariant mode is on and passed the loader's self-test (specd/engine/exactness.py):
        # greedy output does not depend on batching or speculation.
        self.exact = False
        # All layers in one fused op (torch.ops.specd_cpu.decoder_stack), where it applies: its
        # per-layer weights, biases and output sizes, built by prepare().
        self.stack: tuple[list[torch.Tensor], list[torch.Tensor | None], list[int]] | None = None

    def prepare(self, head_ids: torch.Tensor | None = None, batch_invariant: bool = True) -> None:
        """After the weights are loaded: pick the matmul path (specd/engine/model/linear.py), build the
        output head (over `head_ids` only when given: a drafter's draft vocabulary), and set up
        batch-invariant mode, in which a token's logits do not depend on what else the step
        computes (greedy speculation then gives the plain tokens in bf16 too). Whether this
        machine's kernels keep that promise is checked on the real forward by the loader
        (specd/engine/exactness.py), which turns the mode off where they do not."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        max_rows = INVARIANT_MAX_ROWS if batch_invariant else None
        if self.head is None:  # (a GGUF loader builds its quantized head itself)
            if head_ids is not None:
                self.head_ids = head_ids.to(weight.device)
                weight = weight.index_select(0, self.head_ids).contiguous()
            self.head = fast_linear(weight, max_rows=max_rows)
        elif head_ids is not None:
            raise ValueError("a draft vocabulary (draft_vocab.json) needs float weights, not a quantized head")
        adopt_linears(self.model, max_rows)
        fused = self.use_fused_ops(weight.device, weight.dtype)
        self.stack = self.stack_tensors() if fused else None
        self.set_batch_invariant(batch_invariant)

    def use_fused_ops(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Route norms, rotary + KV write, attention and SiLU through kernels/cpu_bf16_ops.cpp
        (CPU, bfloat16, where it builds): 37.8 -> 45.8-48.5 tok/s at batch 1 on the default target,
        58.5 with decoder_stack (bench/results/engine_real.md)."""
        from specd.kernels import cpu_ops

        on = device.type == "cpu" and dtype == torch.bfloat16 and cpu_ops.available()
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.fused = on
        return on

    def stack_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor | None], list[int]] | None:
        """decoder_stack's per-layer weights (norms and packed matmuls), biases and output sizes, or
        None where it does not apply: q/k norms, a matmul not packed (bf16 or GGUF-quantized), or
        windows that differ by layer."""
        layers = self.model.layers
        linears = [m for layer in layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                   layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        if (layers[0].self_attn.q_norm is not None
                or not all(isinstance(m, (InvariantCpuLinear, QuantLinear)) for m in linears)
                or len({layer.self_attn.window for layer in layers}) != 1):
            return None
        weights = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            weights += [layer.input_layernorm.weight.detach(), attn.qkv_proj.packed, attn.o_proj.packed,
                        layer.post_attention_layernorm.weight.detach(), mlp.gate_up_proj.packed, mlp.down_proj.packed]
        return weights, [m.bias for m in linears], [m.out_features for m in linears]

    def _stack_applies(self, meta: AttentionMetadata, capture: tuple[int, ...]) -> bool:
        """decoder_stack runs this step: its tensors are built (its matmuls are then
        kernels/cpu_bf16_matmul.cpp, the same bits at any row count), no layer's input is captured,
        and the step's attention is the fused op."""
        attn = self.model.layers[0].self_attn
        return (self.stack is not None and set(capture) <= {len(self.model.layers)} and meta.token_seq is not None
                and attn.fused_attention_applies(meta))

    def _layers(self, x, cos_sin, kv_caches, meta, capture, captured: dict):
        """The layers one by one -> (residual stream, last MLP output or None: not yet added)."""
        fused, mlp_out = self.model.norm.fused, None
        for j, (layer, kv) in enumerate(zip(self.model.layers, kv_caches)):
            if fused:  # the previous layer's residual add happens in this layer's norm op
                norm = layer.input_layernorm
                x, y = (x, norm.forward(x)) if mlp_out is None else \
                    torch.ops.specd_cpu.add_rms_norm(mlp_out, x, norm.weight, norm.eps)
            if j in capture:
                captured[j] = x
            x, mlp_out = layer.forward_fused(x, y, cos_sin, kv, meta) if fused else \
                (layer.forward(x, cos_sin, kv, meta), None)
        return x, mlp_out

    def set_batch_invariant(self, on: bool) -> None:
        for module in self.modules():
            if isinstance(module, Attention):
                module.invariant = on
            elif hasattr(module, "max_rows"):
                module.max_rows = INVARIANT_MAX_ROWS if on else None

    def forward(
        self,
        token_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer
        logits_indices: torch.Tensor,  # [N] rows of the flattened batch that need logits
        capture: tuple[int, ...] = (),
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits [N, vocab] float32; with `capture`, also the hidden states of every token of
        the step at those indices (Hugging Face's output_hidden_states convention: j < L is the
        residual stream entering layer j, L the final normed state), concatenated [T, len * H].
        They come from this same forward: hidden-state drafters cost no second pass."""
        x = self.model.embed_tokens(token_ids)
        cos_sin = self.rotary(positions)  # once per step, shared by all layers
        L = len(self.model.layers)
        captured = {}
        if self._stack_applies(meta, capture):
            # Every layer in one C++ call; the loop below computes the same, op by op.
            first = self.model.layers[0]
            attn = first.self_attn
            x, mlp_out = torch.ops.specd_cpu.decoder_stack(
                x, *self.stack, [kv[0] for kv in kv_caches], [kv[1] for kv in kv_caches], *cos_sin,
                meta.slot_mapping, meta.block_tables, meta.token_seq, meta.token_pos, attn.key_index(meta),
                attn.h, attn.d, attn.scale, attn.window or 0, first.input_layernorm.eps)
        else:
            x, mlp_out = self._layers(x, cos_sin, kv_caches, meta, capture, captured)
        if mlp_out is not None:
            x = x + mlp_out
        if L in capture:
            x = self.model.norm.forward(x)
            captured[L] = x
            x = x.index_select(0, logits_indices)
        else:
            x = self.model.norm.forward(x.index_select(0, logits_indices))
        logits = self.head.forward(x).float()
        if self.head_ids is not None:
            full = logits.new_full((x.shape[0], self.config.vocab_size), float("-inf"))
            logits = full.index_copy_(1, self.head_ids, logits)
        if not capture:
            return logits
        return logits, torch.cat([captured[j] for j in capture], dim=-1)
