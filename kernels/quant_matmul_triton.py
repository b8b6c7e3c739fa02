"""y = x W^T (+ b) with W stored as int8 or int4 in groups of 32 along K, batch-invariant, in Triton.

Weight-only quantization on a GPU (issue 32): decode reads every weight once per token, so int8
halves and int4 quarters the bytes read per token against bf16. The format is the one GGUF's
Q8_0, Q4_0 and Q4_1 map onto without loss (a scale, and for 4 bits a min, per 32 weights of a row):

    bits=8: qweight int8 [N, K], scales [N, K/32] (float16 or float32): w = scale * q
    bits=4: qweight uint8 [N, K/2], k even in the low nibble, k odd in the high one, q in 0..15;
            scales and mins [N, K/32], one dtype: w = scale * q + min  (Q4_0 is min = -8 * scale)

Batch invariance as in matmul_invariant_triton.py: every program owns a BLOCK_M x BLOCK_N tile of
the output, dequantizes each BLOCK_K x BLOCK_N weight tile in registers (scale * q (+ min) in
float32, rounded to x's dtype) and walks K in fixed BLOCK_K steps from 0 upwards, accumulating in
float32; a row's result depends only on its own inputs, the weights and these constants, never on M.
No split-K, no autotuning (which would choose constants per shape). 16-bit x goes to the tensor
cores with the dequantized tile in its own dtype (each product exact in float32, the MMA's order
fixed by the tile); float32 x takes the IEEE path (no TF32). Under TRITON_INTERPRET every dtype is
multiplied in float32 and summed over each BLOCK_K step in order (tl.sum, not tl.dot: numpy's BLAS
rounds a row differently by its place in the 16-row tile, so rows would change with M); the tile is
still rounded to x's dtype first, so the products are the native path's (for bfloat16 by bit
arithmetic: the interpreter's cast truncates).
quantize_weight (round to nearest per group) makes this format from a
float weight, dequantize_weight is the reference. Tested against the reference and for row
invariance under TRITON_INTERPRET=1 (tests/kernels/test_quant_matmul_triton.py); timed against
cuBLAS on a GPU by bench/gpu_quant.py. Importing this module needs Triton.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

GROUP = 32  # weights per scale (and min) along K; BLOCK_K is a multiple of it
BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 256
NUM_WARPS, NUM_STAGES = 4, 3


@triton.jit
def _round_to_bf16(v):
    """float32 -> the float32 that is its nearest bfloat16 (ties to even; finite values). The
    interpreter's .to(tl.bfloat16) truncates instead (Triton 3.7), which would make the tile and
    the output differ from the native path's by an ulp in about half of the elements."""
    b = v.to(tl.uint32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _load_tiles(x_ptr, q_ptr, s_ptr, m_ptr, k0, rows, cols, M, N, K, x_stride_m, q_stride_n, s_stride_n,
                BITS: tl.constexpr, GROUP_K: tl.constexpr, BK: tl.constexpr):
    """x [BM, BK], the weight tile as stored ([BN, BK] int8 or [BN, BK/2] bytes, K contiguous: wide
    loads) and its scales and mins [BN, BK/32] (scales again for 8 bits), masked to 0 past M, N, K."""
    k = k0 + tl.arange(0, BK)
    x = tl.load(x_ptr + rows[:, None] * x_stride_m + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)
    n_ok = cols[:, None] < N
    g = k0 // GROUP_K + tl.arange(0, BK // GROUP_K)
    smask = n_ok & (g[None, :] < K // GROUP_K)
    scale = tl.load(s_ptr + cols[:, None] * s_stride_n + g[None, :], mask=smask, other=0.0)
    if BITS == 8:
        q = tl.load(q_ptr + cols[:, None] * q_stride_n + k[None, :], mask=n_ok & (k[None, :] < K), other=0)
        mn = scale
    else:
        j = k0 // 2 + tl.arange(0, BK // 2)  # the bytes of k0 .. k0 + BK
        q = tl.load(q_ptr + cols[:, None] * q_stride_n + j[None, :], mask=n_ok & (j[None, :] < K // 2), other=0)
        mn = tl.load(m_ptr + cols[:, None] * s_stride_n + g[None, :], mask=smask, other=0.0)
    return x, q, scale, mn


@triton.jit
def _dequantize(q, scale, mn, BITS: tl.constexpr, GROUP_K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """The float32 weight tile [BK, BN]: scale * q (+ min), scales broadcast over each group by a reshape."""
    s = scale.to(tl.float32)[:, :, None]
    if BITS == 8:
        w = tl.reshape(q.to(tl.float32), [BN, BK // GROUP_K, GROUP_K]) * s
    else:
        b = q.to(tl.int32)
        q4 = tl.reshape(tl.join(b & 0xF, b >> 4), [BN, BK // GROUP_K, GROUP_K])  # k even low nibble, odd high
        w = q4.to(tl.float32) * s + mn.to(tl.float32)[:, :, None]
    return tl.trans(tl.reshape(w, [BN, BK]))


@triton.jit
def _quant_matmul_kernel(x_ptr, q_ptr, s_ptr, m_ptr, b_ptr, y_ptr, M, N, K,
                         x_stride_m, q_stride_n, s_stride_n, y_stride_m,
                         BITS: tl.constexpr, HAS_BIAS: tl.constexpr, NATIVE_DOT: tl.constexpr, INTERPRETED: tl.constexpr,
                         BF16_BY_BITS: tl.constexpr,
                         GROUP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        x, q, scale, mn = _load_tiles(x_ptr, q_ptr, s_ptr, m_ptr, k0, rows, cols, M, N, K, x_stride_m, q_stride_n,
                                      s_stride_n, BITS, GROUP_K, BK)
        w = _dequantize(q, scale, mn, BITS, GROUP_K, BN, BK)
        if BF16_BY_BITS:  # interpreted bf16: the same rounding as natively, kept in float32
            w = _round_to_bf16(w)
        else:
            w = w.to(x_ptr.dtype.element_ty)  # the tile in x's dtype, as a 16-bit weight would be
        if NATIVE_DOT:
            acc += tl.dot(x, w)
        elif INTERPRETED:  # numpy's BLAS can round a row differently by its place in the tile: sum in order
            acc += tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
        else:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if BF16_BY_BITS:
        acc = _round_to_bf16(acc)  # then the store's truncating cast is exact
    tl.store(y_ptr + rows[:, None] * y_stride_m + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def _native_dot(x: torch.Tensor) -> bool:
    return x.dtype in (torch.bfloat16, torch.float16) and x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"


def _check(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int,
           K: int | None = None) -> tuple[int, int]:
    """(N, K) of a quantized weight; ValueError where the tensors are not the format above."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if qweight.dim() != 2 or scales.dim() != 2:
        raise ValueError(f"qweight and scales must be 2-D, got {tuple(qweight.shape)} and {tuple(scales.shape)}")
    N = qweight.shape[0]
    Kq = qweight.shape[1] * (2 if bits == 4 else 1)
    if K is not None and K != Kq:
        raise ValueError(f"x has K = {K} but a {bits}-bit qweight of shape {tuple(qweight.shape)} has K = {Kq}")
    if Kq % GROUP:
        raise ValueError(f"K must be a multiple of {GROUP}: got K = {Kq} (qweight {tuple(qweight.shape)}, bits={bits})")
    want = torch.int8 if bits == 8 else torch.uint8
    if qweight.dtype != want:
        raise ValueError(f"a {bits}-bit qweight is {want}, got {qweight.dtype}")
    if tuple(scales.shape) != (N, Kq // GROUP) or scales.dtype not in (torch.float16, torch.float32):
        raise ValueError(f"scales must be float16 or float32 of shape {(N, Kq // GROUP)}, "
                         f"got {scales.dtype} {tuple(scales.shape)}")
    if bits == 4:
        if mins is None or tuple(mins.shape) != tuple(scales.shape) or mins.dtype != scales.dtype:
            raise ValueError(f"4 bits need mins of scales' shape {tuple(scales.shape)} and dtype {scales.dtype}, got "
                             + ("None" if mins is None else f"{mins.dtype} {tuple(mins.shape)}"))
    return N, Kq


def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None,
                 bits: int = 8, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ dequantize_weight(qweight, scales, mins, bits)^T (+ bias [N]) -> [M, N] in x's dtype."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got {tuple(x.shape)}")
    if x.shape[1] % GROUP:
        raise ValueError(f"K must be a multiple of {GROUP}: got x of shape {tuple(x.shape)}")
    M, K = x.shape
    N, _ = _check(qweight, scales, mins, bits, K)
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"bias must be [{N}], got {tuple(bias.shape)}")
    x, qweight, scales = x.contiguous(), qweight.contiguous(), scales.contiguous()
    mins = mins.contiguous() if mins is not None else scales  # unread for 8 bits
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    _quant_matmul_kernel[grid](x, qweight, scales, mins, bias if bias is not None else x, y, M, N, K,
                               x.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
                               BITS=bits, HAS_BIAS=bias is not None, NATIVE_DOT=_native_dot(x), INTERPRETED=interpreted,
                               BF16_BY_BITS=interpreted and x.dtype == torch.bfloat16,
                               GROUP_K=GROUP,
                               BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, num_warps=NUM_WARPS,
                               num_stages=NUM_STAGES)
    return y


def quantize_weight(w: torch.Tensor, bits: int, group: int = GROUP, scale_dtype: torch.dtype = torch.float16
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(qweight, scales, mins) of a float weight [N, K], rounding to nearest per group of `group` along K.

    bits=8: symmetric, scale = absmax / 127, q = round(w / scale) in -127..127, mins None.
    bits=4: asymmetric, min = the group's min, scale = (max - min) / 15, q = round((w - min) / scale)
    in 0..15. Scales and mins are stored in scale_dtype (float16 as GGUF, or float32) and q is
    computed from the stored values, so each element is off by at most half a step (scale / 2) of
    its group, plus, for 4 bits, the rounding of min to scale_dtype (well under a step unless a
    group's values sit far from zero relative to their spread)."""
    if group != GROUP:
        raise ValueError(f"the kernel reads groups of {GROUP}, got group = {group}")
    if w.dim() != 2 or w.shape[1] % group:
        raise ValueError(f"K must be a multiple of {group}: got a weight of shape {tuple(w.shape)}")
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    N, K = w.shape
    wg = w.detach().float().reshape(N, K // group, group)
    if bits == 8:
        scale = (wg.abs().amax(-1) / 127).to(scale_dtype)
        s = scale.float()
        q = torch.round(wg / torch.where(s > 0, s, 1.0)[..., None]).clamp_(-127, 127)
        return q.to(torch.int8).reshape(N, K).contiguous(), scale.contiguous(), None
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale, mn = ((hi - lo) / 15).to(scale_dtype), lo.to(scale_dtype)
    s, m = scale.float(), mn.float()
    q = torch.round((wg - m[..., None]) / torch.where(s > 0, s, 1.0)[..., None]).clamp_(0, 15).to(torch.uint8)
    q = q.reshape(N, K)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    return packed.contiguous(), scale.contiguous(), mn.contiguous()


def dequantize_weight(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int) -> torch.Tensor:
    """The reference: the float32 [N, K] weight that quant_matmul multiplies by."""
    N, K = _check(qweight, scales, mins, bits)
    if bits == 8:
        q = qweight.float()
    else:
        b = qweight.to(torch.int32)
        q = torch.stack([b & 0xF, b >> 4], dim=-1).reshape(N, K).float()
    s = scales.float().repeat_interleave(GROUP, dim=1)
    w = q * s
    if bits == 4:
        w = w + mins.float().repeat_interleave(GROUP, dim=1)
    return w
