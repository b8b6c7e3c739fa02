"""The matmul path per device and dtype, chosen from measurements on the CPU it runs on.

bfloat16 on CPU: oneDNN with each weight reordered once, at load, into its blocked layout
(`mkldnn._reorder_linear_weight`, what torch.compile's freezing pass does), instead of
`F.linear`, which repacks on every call. Measured on the 2-core Xeon (AVX-512, AMX) with
2 threads, SmolLM2-135M shapes: 1.5x (576x960) to 2.1x (the 49152-row head) faster at 1, 5
and 32 rows, with results bit-identical to F.linear there; equal speed at 256 rows.
float32: F.linear (MKL) reads 25 GB/s there and a prepacked MKL weight 23 GB/s, so float32
and every other device keep F.linear. bench/engine.py measures both paths side by side.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def prepacked_bf16_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PrepackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's blocked layout (CPU, bfloat16)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # The row-count hint picks the blocking; 1 (decode) is also the fastest at 5 and 32.
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1),
                             persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class PlainLinear(nn.Module):
    """F.linear over a weight that another module owns (the tied head reads the embeddings)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def fast_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
    """The fastest exact matmul module for this weight's device and dtype."""
    if prepacked_bf16_available(weight.device, weight.dtype):
        return PrepackedLinear(weight, bias)
    if bias is None:
        return PlainLinear(weight.detach())
    linear = nn.Linear(weight.shape[1], weight.shape[0], device=weight.device, dtype=weight.dtype)
    linear.weight.data, linear.bias.data = weight.detach(), bias.detach()
    return linear


def prepack_linears(model: nn.Module) -> None:
    """Swap every nn.Linear in model for its prepacked form where that path applies."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and prepacked_bf16_available(child.weight.device, child.weight.dtype):
                setattr(module, child_name, PrepackedLinear(child.weight, child.bias))
