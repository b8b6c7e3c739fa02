"""The sampler's passes over vocabulary-wide float32 rows: the fused CPU ops
(kernels/cpu_sampling_ops.cpp) where they are loaded, torch elsewhere (a GPU, SPECD_CPU_KERNELS=0,
a CPU they are not built for).

The fused ones pick the same argmax as torch, and draw by the inverse CDF from the same point
u x total in float64 (summed per block of 64, so a token on the edge of two may go the other way
by a rounding of ~1e-16).
"""
from __future__ import annotations

import torch

from specd.kernels import cpu_ops


def fused(rows: torch.Tensor) -> bool:
    return rows.device.type == "cpu" and rows.dtype == torch.float32 and cpu_ops.available()


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R] int64
    """The first index of each row's maximum (torch.argmax's choice among ties)."""
    if fused(logits):
        return torch.ops.specd_cpu.argmax_rows(logits)
    # max().indices: the same index as argmax, 2.5x faster on a 49k-wide row on the EPYC's torch.
    return logits.max(dim=-1).indices


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:  # [B, V], [B] float64 -> [B]
    """A token per row from norm(probs) at the uniform u in [0, 1): the first whose cumulative
    weight (float64) exceeds u times the row's total; a token of weight 0 is never drawn."""
    if fused(probs):
        return torch.ops.specd_cpu.inverse_cdf(probs, u.double())
    return inverse_cdf_torch(probs, u)


def inverse_cdf_torch(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """inverse_cdf by a float64 cumulative sum and a binary search (a float32 sum of 49k terms
    rounds by ~1e-7, so a token of probability 1e-8 would be drawn at a rate that rounding sets).
    The point is kept strictly below the total whatever u is, so the token found is one where the
    sum rises: a token of weight 0 (filtered, masked by a grammar, or outside a residual) is never
    drawn."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    total = cdf[:, -1]
    x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x[:, None], right=True).squeeze(1).clamp_max(probs.shape[-1] - 1)
