"""A CausalLM straight from a GGUF file, its matmuls in the file's own quantized types.

The model is built on the meta device and filled module by module. On CPU: matmul weights become
QuantLinear (packed GGUF blocks, specd/engine/model/quant.py) where kernels/cpu_quant_matmul.cpp has the
type, the embeddings a QuantEmbedding, norms and biases bfloat16. Nothing is dequantized in bulk, so
the resident size stays near the file's while loading too. On a GPU (or on CPU with
SPECD_FORCE_TRITON=1, the tests' stand-in): Q8_0 parts become int8 and Q4_0 / Q4_1 parts int4 for
kernels/quant_matmul_triton.py (GroupQuantLinear), the embeddings bfloat16. A tensor whose type has
no kernel on the device is dequantized to bfloat16, with a log line naming the type; a type the
gguf package cannot read fails naming the file, tensor and type.
"""
from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch import nn

from specd.engine.model.config import ModelArchConfig
from specd.engine.model.decoder import CausalLM
from specd.engine.model.linear import fast_linear
from specd.engine.model.quant import (GPU_TYPES, KERNEL_TYPES, GroupQuantLinear, QuantEmbedding, QuantLinear, QuantPart,
                                gpu_weights, pack)
from specd.models import gguf_convert

log = logging.getLogger(__name__)


class _Tensors:
    """The file's tensors by Hugging Face name, as QuantParts and as dequantized values."""

    def __init__(self, path: Path, arch: ModelArchConfig, triton: bool = False):
        import gguf

        self.path, self.arch, self.triton = path, arch, triton
        self.device = torch.device("cuda" if triton and torch.cuda.is_available() else "cpu")
        architecture, infos = gguf_convert.read_header(path)
        self.permute_qk = gguf_convert.ARCHITECTURES[architecture][1]
        self.by_name = {}
        for t in infos:
            name = gguf_convert._hf_name(t.name, path)
            if name is not None:
                self.by_name[name] = t
        self.type_name = lambda q: gguf.GGMLQuantizationType(q).name
        self.no_kernel: Counter = Counter()

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def _heads(self, name: str) -> int | None:
        if not self.permute_qk:
            return None
        if name.endswith("q_proj.weight"):
            return self.arch.num_heads
        return self.arch.num_kv_heads if name.endswith("k_proj.weight") else None

    def part(self, name: str) -> QuantPart:
        t = self.by_name[name]
        cols, rows = (int(d) for d in t.shape)
        part = QuantPart(t.name, int(t.tensor_type), rows, cols, str(self.path), int(t.data_offset))
        heads = self._heads(name)
        if heads:
            part.row_order = gguf_convert._unpermute(np.arange(rows)[:, None], heads).ravel()
        return part

    def dense(self, name: str) -> torch.Tensor:
        """Dequantized, as float32 (GGML's parts are fp16 scales and small ints: exact in float32)."""
        import gguf

        t = self.by_name[name]
        qtype = gguf.GGMLQuantizationType(t.tensor_type)
        raw = np.fromfile(self.path, dtype=np.uint8, count=t.n_bytes, offset=t.data_offset)
        try:
            w = gguf.quants.dequantize(raw, qtype).astype(np.float32, copy=False)
        except NotImplementedError:
            raise gguf_convert.GGUFError(f"{self.path}: tensor {t.name} has quantization {qtype.name}, "
                                         "which the gguf package cannot dequantize") from None
        w = w.reshape([int(d) for d in reversed(t.shape)])
        heads = self._heads(name)
        if heads:
            w = gguf_convert._unpermute(w, heads)
        return torch.from_numpy(np.ascontiguousarray(w))

    def linear(self, names: list[str], biases: list[str]) -> nn.Module:
        parts = [self.part(n) for n in names]
        bias = None
        if all(b in self for b in biases) and biases:
            bias = torch.cat([self.dense(b) for b in biases]).to(torch.bfloat16)  # as a bf16 checkpoint holds it
        if self.triton:
            return self._gpu_linear(names, parts, bias)
        if all(p.has_kernel() for p in parts):
            return QuantLinear(pack(parts), sum(p.rows for p in parts), parts[0].cols, bias)
        for p in parts:
            if not p.has_kernel():
                self.no_kernel[self.type_name(p.qtype)] += 1
        weight = torch.cat([self.dense(n) for n in names]).to(torch.bfloat16)
        return fast_linear(weight, bias)

    def _gpu_linear(self, names: list[str], parts: list[QuantPart], bias: torch.Tensor | None) -> nn.Module:
        pieces = []
        for name, p in zip(names, parts):
            if p.qtype in GPU_TYPES and p.cols % 32 == 0:
                pieces.append(tuple(t if not isinstance(t, torch.Tensor) else t.to(self.device) for t in gpu_weights(p)))
            else:
                self.no_kernel[self.type_name(p.qtype)] += 1
                pieces.append((0, self.dense(name).to(self.device, torch.bfloat16)))
        return GroupQuantLinear(pieces, parts[0].cols, None if bias is None else bias.to(self.device))

    def param(self, name: str) -> nn.Parameter:
        return nn.Parameter(self.dense(name).to(self.device, torch.bfloat16), requires_grad=False)


def load_gguf_model(path: Path, arch: ModelArchConfig, max_positions: int, triton: bool = False) -> CausalLM:
    """The model of `path`, bfloat16 activations, matmuls in the file's types: on CPU with the C++
    kernels, or with the Triton ones (triton=True: on the GPU where there is one). The caller
    prepares it (CausalLM.prepare) and runs the exactness self-test as for any checkpoint."""
    tensors = _Tensors(path, arch, triton)
    with torch.device("meta"):
        model = CausalLM(arch, max_positions)
    for j, layer in enumerate(model.model.layers):
        pre = f"model.layers.{j}."
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [f"{pre}self_attn.{p}_proj" for p in "qkv"]
        attn.qkv_proj = tensors.linear([f"{n}.weight" for n in qkv], [f"{n}.bias" for n in qkv])
        attn.o_proj = tensors.linear([f"{pre}self_attn.o_proj.weight"], [f"{pre}self_attn.o_proj.bias"])
        mlp.gate_up_proj = tensors.linear([f"{pre}mlp.gate_proj.weight", f"{pre}mlp.up_proj.weight"], [])
        mlp.down_proj = tensors.linear([f"{pre}mlp.down_proj.weight"], [])
        layer.input_layernorm.weight = tensors.param(f"{pre}input_layernorm.weight")
        layer.post_attention_layernorm.weight = tensors.param(f"{pre}post_attention_layernorm.weight")
        if attn.q_norm is not None:
            attn.q_norm.weight = tensors.param(f"{pre}self_attn.q_norm.weight")
            attn.k_norm.weight = tensors.param(f"{pre}self_attn.k_norm.weight")
    model.model.norm.weight = tensors.param("model.norm.weight")
    embed = tensors.part("model.embed_tokens.weight")
    if embed.has_kernel() and not triton:
        model.model.embed_tokens = QuantEmbedding(pack([embed]), embed.rows, embed.cols)
    else:  # (on a GPU the table is bfloat16: a lookup reads a few rows, the head reads them all)
        if not triton:
            tensors.no_kernel[tensors.type_name(embed.qtype)] += 1
        model.model.embed_tokens = nn.Embedding.from_pretrained(
            tensors.dense("model.embed_tokens.weight").to(tensors.device, torch.bfloat16), freeze=True)
    if "lm_head.weight" in tensors:
        model.head = tensors.linear(["lm_head.weight"], [])
    elif isinstance(model.model.embed_tokens, QuantEmbedding):  # tied: one copy of the table serves both
        model.head = QuantLinear(model.model.embed_tokens.packed, embed.rows, embed.cols, None)
    else:
        model.head = tensors.linear(["model.embed_tokens.weight"], [])
    model.lm_head = None
    model.rotary.build(tensors.device, torch.bfloat16)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise gguf_convert.GGUFError(f"{path}: no tensor for {', '.join(left[:5])}")
    for qtype, n in sorted(tensors.no_kernel.items()):
        log.warning("%s: %d tensors of type %s have no quantized kernel %s; dequantized to bfloat16", path, n, qtype,
                    "on the GPU" if triton else "here")
    model.quantization = quantization_summary(model)
    return model


def quantization_summary(model: nn.Module) -> str:
    """The matmuls' types with their share of the weights' bytes, e.g. 'Q5_0 61%, Q8_0 27%, ...'."""
    import gguf

    sizes: Counter = Counter()
    for m in model.modules():
        if isinstance(m, GroupQuantLinear):
            for p in m.parts:
                if p[0]:
                    sizes[f"int{p[0]}"] += p[1].numel() * p[1].element_size()
    for m in {id(m): m for m in model.modules() if isinstance(m, (QuantLinear, QuantEmbedding))}.values():
        header = m.packed[:32].numpy().view(np.int64)
        for i in range(int(header[3])):
            qtype, rows, _, row_bytes = m.packed[32 + 32 * i:64 + 32 * i].numpy().view(np.int64)
            sizes[gguf.GGMLQuantizationType(int(qtype)).name] += int(rows * row_bytes)
    total = sum(sizes.values()) or 1
    return ", ".join(f"{name} {100 * n / total:.0f}%" for name, n in sizes.most_common())


def has_quantized_matmuls(path: Path, triton: bool = False) -> bool:
    """Whether the file holds a 2-D tensor of a type the quantized kernels (CPU, or Triton's) compute on."""
    types = GPU_TYPES if triton else KERNEL_TYPES
    return any(len(t.shape) == 2 and t.tensor_type in types for t in gguf_convert.read_header(path)[1])
