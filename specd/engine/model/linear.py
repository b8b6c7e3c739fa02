"""The matmul path per device and dtype, chosen from measurements on the CPU it runs on.

bfloat16 on CPU with the fused ops (kernels/cpu_bf16_matmul.cpp, where they build): a matmul whose
every output sums over K in one fixed order, whatever the row count, so a row's bits are the same
alone, in a verify block or in a prefill chunk. oneDNN picks its K blocking from the row count: on
an AMD EPYC (avx512_bf16, no AMX) a 1-row and a 4-row call differ in the last bit for K > 1024,
which changed greedy tokens with batching and speculation. Measured there with 2 threads on the
default target's shapes, weights streamed from memory: 0.71x oneDNN's time at 1 row, 0.75-0.87x at
5-16, 1.04-1.12x at 64-128 (bench/cpu_matmul.py).
bfloat16 on CPU without them (the torch path): oneDNN with each weight reordered once, at load, into its blocked layout
(`mkldnn._reorder_linear_weight`, what torch.compile's freezing pass does), instead of
`F.linear`, which repacks on every call. Measured on the 2-core Xeon (AVX-512, AMX) with
2 threads, SmolLM2-135M shapes: 1.5x (576x960) to 2.1x (the 49152-row head) faster at 1, 5
and 32 rows, with results bit-identical to F.linear there; equal speed at 256 rows.
float32: F.linear (MKL) reads 25 GB/s there and a prepacked MKL weight 23 GB/s, so float32
and every other device keep F.linear. bench/engine.py measures both paths side by side.
In batch-invariant mode (the default) a GPU uses the Triton matmul of
kernels/matmul_invariant_triton.py, whose reduction order does not depend on the row count.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn


def prepacked_bf16_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def invariant_cpu_available(device: torch.device, dtype: torch.dtype) -> bool:
    from specd.kernels import cpu_ops

    return device.type == "cpu" and dtype == torch.bfloat16 and cpu_ops.available()


class PrepackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's blocked layout (CPU, bfloat16)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.max_rows = max_rows
        # The row-count hint picks the blocking; 1 (decode) is also the fastest at 5 and 32.
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1),
                             persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _by_rows(lambda rows: torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], ""),
                        x, self.max_rows)


class InvariantCpuLinear(nn.Module):
    """y = x W^T + b through kernels/cpu_bf16_matmul.cpp (CPU, bfloat16): batch-invariant by construction."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.max_rows = max_rows  # unused: any row count gives the same bits
        self.register_buffer("packed", torch.ops.specd_cpu.pack_linear_weight(weight.detach().contiguous()),
                             persistent=False)
        # float32 once here, not per call (the kernel adds the bias in float32).
        self.register_buffer("bias", None if bias is None else bias.detach().float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.specd_cpu.linear(x, self.packed, self.bias, self.out_features)


class PlainLinear(nn.Module):
    """F.linear; the weight may belong to another module (the tied head reads the embeddings)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, max_rows: int | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight, self.bias, self.max_rows = weight, bias, max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _by_rows(lambda rows: F.linear(rows, self.weight, self.bias), x, self.max_rows)


class TritonInvariantLinear(PlainLinear):
    """Batch-invariant mode on a GPU: kernels/matmul_invariant_triton.py (fixed tiles, no
    split-K), where cuBLAS may change a row's reduction order with the row count."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.max_rows is None:  # the mode is off
            return F.linear(x, self.weight, self.bias)
        from specd.kernels.matmul_invariant_triton import matmul_invariant

        return matmul_invariant(x, self.weight, self.bias)


def _triton_matmul_wanted(device: torch.device) -> bool:
    if device.type != "cuda" and os.environ.get("SPECD_FORCE_TRITON") != "1":  # forced: tests, interpreter
        return False
    try:
        import specd.kernels.matmul_invariant_triton  # noqa: F401
    except ImportError:
        return False
    return True


def _by_rows(fn, x: torch.Tensor, max_rows: int | None) -> torch.Tensor:
    # Batch-invariant mode on the torch path: no call sees more than max_rows rows (oneDNN and
    # MKL change their reduction blocking for large M on some thread counts); whether smaller
    # calls keep a row's bits is the loader's self-test's call (specd/engine/exactness.py).
    if max_rows is None or x.shape[0] <= max_rows:
        return fn(x)
    return torch.cat([fn(x[i:i + max_rows]) for i in range(0, x.shape[0], max_rows)])


def fast_linear(weight: torch.Tensor, bias: torch.Tensor | None = None, max_rows: int | None = None) -> nn.Module:
    """The fastest matmul module for this weight's device and dtype."""
    weight = weight.detach()
    bias = None if bias is None else bias.detach()
    if invariant_cpu_available(weight.device, weight.dtype):
        return InvariantCpuLinear(weight, bias, max_rows)
    if prepacked_bf16_available(weight.device, weight.dtype):
        return PrepackedLinear(weight, bias, max_rows)
    if max_rows is not None and _triton_matmul_wanted(weight.device):
        return TritonInvariantLinear(weight, bias, max_rows)
    return PlainLinear(weight, bias, max_rows)


def adopt_linears(model: nn.Module, max_rows: int | None = None) -> None:
    """Swap every nn.Linear in model for fast_linear's module (one shared by several parents stays
    one)."""
    swapped: dict[int, nn.Module] = {}
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                if id(child) not in swapped:
                    swapped[id(child)] = fast_linear(child.weight, child.bias, max_rows)
                setattr(module, name, swapped[id(child)])
