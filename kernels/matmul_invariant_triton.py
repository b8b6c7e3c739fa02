"""y = x W^T (+ b) in Triton with one reduction order per output element, whatever the row count.

Batch-invariant mode on a GPU (specd/engine/model/linear.py): cuBLAS picks its tiling, and split-K,
from the problem size, so a row's result can change with the number of rows computed with it.
Here every program owns a BLOCK_M x BLOCK_N tile of the output and walks K in fixed BLOCK_K
steps from 0 upwards, accumulating in float32: a row's result depends only on its own inputs,
the weights and these constants, never on M. 16-bit inputs go to the tensor cores as they are
(each product is exact in float32, the MMA's order fixed by the tile); float32 inputs take the
IEEE path (no TF32 rounding), as 16-bit inputs do under TRITON_INTERPRET, whose numpy dot has
no bfloat16. No split-K, no autotuning (which would choose
constants per shape). Tested against torch and for row invariance under TRITON_INTERPRET=1
(tests/kernels/test_matmul_invariant.py); importing this module needs Triton.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K,
                   x_stride_m, w_stride_n, y_stride_m,
                   HAS_BIAS: tl.constexpr, NATIVE_DOT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + ks
        x = tl.load(x_ptr + rows[:, None] * x_stride_m + k[None, :],
                    mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + cols[None, :] * w_stride_n + k[:, None],
                    mask=(cols[None, :] < N) & (k[:, None] < K), other=0.0)
        if NATIVE_DOT:
            acc += tl.dot(x, w)
        else:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * y_stride_m + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def _native_dot(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype and x.is_cuda
            and os.environ.get("TRITON_INTERPRET") != "1")


def matmul_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias [N]) -> [M, N] in x's dtype."""
    M, K = x.shape
    N = weight.shape[0]
    x, weight = x.contiguous(), weight.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _matmul_kernel[grid](x, weight, bias if bias is not None else x, y, M, N, K,
                         x.stride(0), weight.stride(0), y.stride(0),
                         HAS_BIAS=bias is not None, NATIVE_DOT=_native_dot(x, weight), BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K)
    return y
