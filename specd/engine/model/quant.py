"""GGUF-quantized weights served in their own types on CPU (kernels/cpu_quant_matmul.cpp).

A matmul weight stays in llama.cpp's blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), packed
into one uint8 tensor per linear: a header, then each part's rows (a fused projection, q/k/v or
gate/up, keeps each part's own type, as llama-quantize mixes them in a Q4_K_M file). The bytes are
read from the file straight into that tensor, so the resident size is about the file's. Embeddings
are dequantized per looked-up row. Types without a kernel here are dequantized to bfloat16 once
(the loader logs which).
"""
from __future__ import annotations

import struct

import numpy as np
import torch
from torch import nn

# GGML type id -> (weights per block, bytes per block): the types kernels/cpu_quant_matmul.cpp computes on.
KERNEL_TYPES = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 12: (256, 144), 13: (256, 176),
                14: (256, 210)}
_MAGIC, _ALIGN = 0x51445053, 64


class QuantPart:
    """One GGUF tensor as rows of blocks: its type, shape [rows, K] and where its bytes are."""

    def __init__(self, name: str, qtype: int, rows: int, cols: int, path: str, offset: int):
        self.name, self.qtype, self.rows, self.cols, self.path, self.offset = name, qtype, rows, cols, path, offset
        self.row_order: np.ndarray | None = None  # rows to take, in order (llama's Q/K unpermute)

    @property
    def row_bytes(self) -> int:
        block, size = KERNEL_TYPES[self.qtype]
        return self.cols // block * size

    def has_kernel(self) -> bool:
        return self.qtype in KERNEL_TYPES and self.cols % KERNEL_TYPES[self.qtype][0] == 0


def read_rows(part: QuantPart, out: np.ndarray | None = None) -> np.ndarray:
    """The part's rows of blocks [rows, row_bytes], read from its file (into `out` where given), in
    its row order."""
    n = part.rows * part.row_bytes
    buf = np.empty(n, dtype=np.uint8) if out is None else out
    with open(part.path, "rb") as f:
        f.seek(part.offset)
        if f.readinto(memoryview(buf)) != n:
            raise ValueError(f"{part.path}: tensor {part.name} is cut short")
    rows = buf.reshape(part.rows, part.row_bytes)
    if part.row_order is not None:
        rows[:] = rows[part.row_order]
    return rows


def pack(parts: list[QuantPart]) -> torch.Tensor:
    """The parts' rows one after another in the kernels' layout (module docstring), read from the
    file into the tensor they end up in."""
    cols = parts[0].cols
    if any(p.cols != cols for p in parts):
        raise ValueError(f"parts of one linear differ in K: {[(p.name, p.cols) for p in parts]}")
    header = 8 * (4 + 4 * len(parts))
    offsets, at = [], -(-header // _ALIGN) * _ALIGN
    for p in parts:
        offsets.append(at)
        at += -(-(p.rows * p.row_bytes) // _ALIGN) * _ALIGN
    packed = torch.zeros(at, dtype=torch.uint8)
    buf = packed.numpy()
    fields = [_MAGIC, cols, sum(p.rows for p in parts), len(parts)]
    for p, off in zip(parts, offsets):
        fields += [p.qtype, p.rows, off, p.row_bytes]
    buf[:header] = np.frombuffer(struct.pack(f"<{len(fields)}q", *fields), dtype=np.uint8)
    for p, off in zip(parts, offsets):
        read_rows(p, buf[off:off + p.rows * p.row_bytes])
    return packed


class QuantLinear(nn.Module):
    """y = x W^T + b on a packed quantized W (bfloat16 in and out)."""

    def __init__(self, packed: torch.Tensor, out_features: int, in_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.max_rows = None  # any row count gives the same bits (set by set_batch_invariant, unused)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.specd_cpu.quant_linear(x, self.packed, self.bias)


class QuantEmbedding(nn.Module):
    """Rows of a quantized embedding table, dequantized as they are looked up (bfloat16)."""

    def __init__(self, packed: torch.Tensor, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.register_buffer("packed", packed, persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """A bfloat16 tensor on the device (what shape and dtype checks read); not the values."""
        return torch.empty(0, self.embedding_dim, dtype=torch.bfloat16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.specd_cpu.quant_dequantize_rows(self.packed, ids.reshape(-1)).to(torch.bfloat16).view(
            *ids.shape, self.embedding_dim)


# On a GPU (kernels/quant_matmul_triton.py): the GGUF types whose blocks map onto its format without
# loss (groups of 32 along K): Q8_0 -> int8 and a scale; Q4_0, Q4_1 -> 4 bits, a scale and a min.
GPU_TYPES = {8: 8, 2: 4, 3: 4}


def gpu_weights(part: QuantPart) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(bits, qweight, scales, mins) of the Triton kernel's format for a part of a GPU_TYPES type."""
    raw = read_rows(part)
    block, size = KERNEL_TYPES[part.qtype]
    blocks = raw.reshape(part.rows, part.cols // block, size)
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]
    if part.qtype == 8:  # Q8_0: d, 32 int8
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(part.rows, part.cols)
        return 8, torch.from_numpy(q), torch.from_numpy(d), None
    nibbles = blocks[..., 2:18] if part.qtype == 2 else blocks[..., 4:20]  # Q4_0: d, 16 bytes; Q4_1: d, m, 16
    q = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=-1)  # GGUF: k 0..15 low nibbles, 16..31 high
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).reshape(part.rows, part.cols // 2)  # kernel: k even low
    mins = -8 * d if part.qtype == 2 else np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0]
    return 4, torch.from_numpy(np.ascontiguousarray(packed)), torch.from_numpy(d), torch.from_numpy(mins)


class GroupQuantLinear(nn.Module):
    """A linear on a GPU whose parts are int8 / int4 weights in groups of 32 (the Triton kernel) or
    dense bfloat16 (types the kernel lacks: kernels/matmul_invariant_triton.py); outputs concatenated."""

    def __init__(self, parts: list[tuple], in_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.max_rows = in_features, None
        self.out_features = sum(p[1].shape[0] for p in parts)
        self.parts = parts  # (bits, qweight, scales, mins) or (0, dense weight)
        for i, part in enumerate(parts):
            for j, t in enumerate(part[1:]):
                self.register_buffer(f"part{i}_{j}", t, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from specd.kernels.matmul_invariant_triton import matmul_invariant
        from specd.kernels.quant_matmul_triton import quant_matmul

        outs = [matmul_invariant(x, p[1]) if p[0] == 0 else quant_matmul(x, *p[1:], bits=p[0]) for p in self.parts]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return y if self.bias is None else y + self.bias
