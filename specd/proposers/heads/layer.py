"""One Llama decoder layer over a per-sequence contiguous KV cache: the body of EAGLE heads.

The engine's DecoderLayer reads a paged cache shared by a batch; a head is one or two layers,
so each sequence keeps a contiguous cache grown by doubling, and a batch runs its projections
over all rows at once and its attention per sequence. RMSNorm, the MLP and rotary are the
engine's own (specd/engine/model/decoder.py, specd/engine/model/rotary.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specd.engine.model.config import ModelArchConfig
from specd.engine.model.decoder import MLP, RMSNorm
from specd.engine.model.rotary import apply_rotary


class KVCache:
    """K/V per head layer for one sequence: positions [0, length) are valid."""

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers  # [capacity, Hkv, D]
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [n, Hkv, D] at positions [length, length + n); return all K, V so far."""
        end = self.length + k.shape[0]
        buf_k, buf_v = self.k[layer], self.v[layer]
        if buf_k is None or buf_k.shape[0] < end:
            cap = max(end, 2 * (0 if buf_k is None else buf_k.shape[0]), 64)
            new_k, new_v = k.new_empty((cap, *k.shape[1:])), v.new_empty((cap, *v.shape[1:]))
            if buf_k is not None:
                new_k[: self.length], new_v[: self.length] = buf_k[: self.length], buf_v[: self.length]
            self.k[layer], self.v[layer] = buf_k, buf_v = new_k, new_v
        buf_k[self.length:end], buf_v[self.length:end] = k, v
        return buf_k[:end], buf_v[:end]

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def fork(self) -> "KVCache":
        """A copy of positions [0, length) that grows on its own (pipelined drafting's branches)."""
        out = KVCache(len(self.k))
        out.length = self.length
        for i, (k, v) in enumerate(zip(self.k, self.v)):
            if k is not None:
                out.k[i], out.v[i] = k[: self.length].clone(), v[: self.length].clone()
        return out


class HeadAttention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, in_dim: int):
        super().__init__()
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(in_dim, (self.h + 2 * self.hkv) * self.d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos_sin, kvs: list[KVCache], counts: list[int], layer: int) -> torch.Tensor:
        """x [T, in_dim]: counts[s] rows of sequence s in turn, at positions [kvs[s].length, + counts[s]).
        Projections run over all T rows at once; attention per sequence over its own cache."""
        T = x.shape[0]
        qkv = self.qkv_proj.forward(x).view(T, self.h + 2 * self.hkv, self.d)
        q, k, v = qkv[:, : self.h], qkv[:, self.h: self.h + self.hkv], qkv[:, self.h + self.hkv:]
        if self.q_norm is not None:
            q, k = self.q_norm.forward(q), self.k_norm.forward(k)
        q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
        out, start, rep = torch.empty_like(q), 0, self.h // self.hkv
        for kv, n in zip(kvs, counts):
            end = start + n
            keys, values = kv.write(layer, k[start:end], v[start:end])  # [C, Hkv, D]
            c = keys.shape[0]
            # query i sits at position c - n + i and sees keys 0 .. c - n + i
            mask = torch.arange(c, device=x.device)[None, :] <= torch.arange(c - n, c, device=x.device)[:, None]
            out[start:end] = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), keys.transpose(0, 1).repeat_interleave(rep, 0),
                values.transpose(0, 1).repeat_interleave(rep, 0), attn_mask=mask).transpose(0, 1)
            start = end
        return self.o_proj.forward(out.reshape(T, self.h * self.d))


def positions(kvs: list[KVCache], counts: list[int], device) -> torch.Tensor:  # [T]
    return torch.cat([torch.arange(kv.length, kv.length + n, device=device) for kv, n in zip(kvs, counts)])


def advance(kvs: list[KVCache], counts: list[int]) -> None:
    for kv, n in zip(kvs, counts):
        kv.length += n


class HeadLayer(nn.Module):
    """Pre-norm decoder layer. in_dim: the attention's input width (EAGLE-3's first layer reads
    2 * hidden); input_norm False: EAGLE-1's first layer has no input_layernorm."""

    def __init__(self, cfg: ModelArchConfig, in_dim: int | None = None, input_norm: bool = True):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if input_norm else None
        self.self_attn = HeadAttention(cfg, in_dim or cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos_sin, kvs: list[KVCache], counts: list[int], layer: int,
                attn_in: torch.Tensor | None = None):
        """x [T, H]: the residual stream (rows as HeadAttention.forward); attn_in: what attention
        reads instead of norm(x)."""
        if attn_in is None:
            attn_in = x if self.input_layernorm is None else self.input_layernorm.forward(x)
        x = x + self.self_attn.forward(attn_in, cos_sin, kvs, counts, layer)
        return x + self.mlp.forward(self.post_attention_layernorm.forward(x))

    def load(self, tensors: dict[str, torch.Tensor], prefix: str, where: str) -> None:
        """Checkpoint names (q_proj/k_proj/v_proj, gate_proj/up_proj) into the fused parameters."""
        from specd.proposers.heads.checkpoint import take

        def get(name, like):
            return take(tensors, prefix + name, tuple(like.shape), where)

        def fused(parts, param):
            t = torch.cat([take(tensors, prefix + p, where=where) for p in parts], 0)
            if t.shape != param.shape:
                raise ValueError(f"{where}: {prefix}{'+'.join(parts)} have shape {tuple(t.shape)} together, "
                                 f"expected {tuple(param.shape)}")
            param.data.copy_(t)

        attn = self.self_attn
        fused(["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"], attn.qkv_proj.weight)
        if attn.qkv_proj.bias is not None:
            fused(["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"], attn.qkv_proj.bias)
        attn.o_proj.weight.data.copy_(get("self_attn.o_proj.weight", attn.o_proj.weight))
        if attn.o_proj.bias is not None:
            attn.o_proj.bias.data.copy_(get("self_attn.o_proj.bias", attn.o_proj.bias))
        for norm in ("q_norm", "k_norm"):
            if getattr(attn, norm) is not None:
                getattr(attn, norm).weight.data.copy_(get(f"self_attn.{norm}.weight", getattr(attn, norm).weight))
        fused(["mlp.gate_proj.weight", "mlp.up_proj.weight"], self.mlp.gate_up_proj.weight)
        self.mlp.down_proj.weight.data.copy_(get("mlp.down_proj.weight", self.mlp.down_proj.weight))
        if self.input_layernorm is not None:
            self.input_layernorm.weight.data.copy_(get("input_layernorm.weight", self.input_layernorm.weight))
        self.post_attention_layernorm.weight.data.copy_(
            get("post_attention_layernorm.weight", self.post_attention_layernorm.weight))


class DecoderHead(nn.Module):
    """A head whose body is `layers`, HeadLayers (EAGLE-1/2 and EAGLE-3): a sequence's cache holds
    one K/V per layer."""

    layers: nn.ModuleList

    def new_cache(self) -> KVCache:
        return KVCache(len(self.layers))
