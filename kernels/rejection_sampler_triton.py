"""Batched rejection sampling as Triton kernels: same signature and results as
rejection_sampler_ref.rejection_sample_ref (see its docstring for the layout and for what
accepted, recovered and bonus tokens are).

One program per sequence; a greedy kernel and a random kernel, each skipping the
other's rows, and the random one not launched at all for an all-greedy batch. The
recovered/bonus draw is one pass over the vocabulary: an exponential race over the
residual max(0, p - q) and, for the rare all-zero residual, over p, kept side by side.
Divisions are IEEE round-to-nearest (div_rn) so results match the reference bit for bit.
Importing this module needs Triton; specd.kernels.rejection_sampler imports it lazily.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specd.kernels.rejection_sampler_ref import STRICT


@triton.jit
def _greedy_kernel(
    out_ptr, num_acc_ptr, cu_ptr, draft_ptr, target_argmax_ptr, is_greedy_ptr, uniforms_ptr,
    out_stride, rate,
    ALL_GREEDY: tl.constexpr, MODE: tl.constexpr,
):
    b = tl.program_id(0)
    if not ALL_GREEDY:
        if not tl.load(is_greedy_ptr + b):
            return
    start = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - start
    first_row = start + b
    rejected = n < 0  # False, typed
    n_acc = n * 0
    for i in range(n):
        if not rejected:
            x = tl.load(draft_ptr + start + i)
            t = tl.load(target_argmax_ptr + first_row + i)
            if MODE == 2:  # SYNTHETIC
                ok = tl.load(uniforms_ptr + start + i) < rate
            else:
                ok = x == t
            if ok:
                tl.store(out_ptr + b * out_stride + i, x)
                n_acc += 1
            else:
                tl.store(out_ptr + b * out_stride + i, t)
                rejected = True
    if not rejected:
        tl.store(out_ptr + b * out_stride + n, tl.load(target_argmax_ptr + first_row + n))
    tl.store(num_acc_ptr + b, n_acc)


@triton.jit
def _random_kernel(
    out_ptr, num_acc_ptr, cu_ptr, draft_ptr, probs_ptr, q_ids_ptr, q_probs_ptr, is_greedy_ptr,
    uniforms_ptr, noise_ptr,
    out_stride, V, KQ, threshold, alpha, rate,
    MODE: tl.constexpr, HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0)
    if tl.load(is_greedy_ptr + b):
        return
    start = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - start
    first_row = start + b
    k_offs = tl.arange(0, BLOCK_K)
    rejected = n < 0  # False, typed
    n_acc = n * 0
    for i in range(n):
        if not rejected:
            x = tl.load(draft_ptr + start + i)
            row = (first_row + i).to(tl.int64)
            p_x = tl.load(probs_ptr + row * V + x)
            if MODE == 0:  # STRICT (mode numbers as in the reference): accept w.p. min(1, p/q)
                q_x = 1.0
                if HAS_Q:
                    ids = tl.load(q_ids_ptr + (start + i) * KQ + k_offs, mask=k_offs < KQ, other=-1)
                    qp = tl.load(q_probs_ptr + (start + i) * KQ + k_offs, mask=k_offs < KQ, other=0.0)
                    q_x = tl.sum(tl.where(ids == x, qp, 0.0), axis=0)
                ok = tl.load(uniforms_ptr + start + i) * q_x < p_x
            elif MODE == 1:  # TYPICAL: p(x) > min(threshold, alpha * exp(-entropy(p)))
                entropy = 0.0
                for v0 in range(0, V, BLOCK_V):
                    offs = v0 + tl.arange(0, BLOCK_V)
                    p = tl.load(probs_ptr + row * V + offs, mask=offs < V, other=0.0)
                    entropy += tl.sum(-(p * tl.log(tl.where(p > 0, p, 1.0))), axis=0)
                ok = p_x > tl.minimum(alpha * tl.exp(-entropy), threshold)
            else:  # SYNTHETIC
                ok = tl.load(uniforms_ptr + start + i) < rate
            if ok:
                tl.store(out_ptr + b * out_stride + i, x)
                n_acc += 1
            else:
                rejected = True
    # One draw per sequence: recovered from max(0, p - q) at the rejection, or the bonus from p.
    row = (first_row + n_acc).to(tl.int64)
    rej = start + n_acc
    if MODE == 0:
        use_q = n_acc < n  # rejected
    else:
        use_q = n < 0  # False: lossy modes draw from p
    x_rej = tl.load(draft_ptr + rej, mask=use_q, other=-1)
    if HAS_Q:
        q_len = tl.where(use_q, KQ, 0)  # no q for a bonus draw (this row may not exist)
        ids = tl.load(q_ids_ptr + rej * KQ + k_offs, mask=k_offs < q_len, other=-1)
        qp = tl.load(q_probs_ptr + rej * KQ + k_offs, mask=k_offs < q_len, other=0.0)
    best_w = -1.0
    best_w_idx = 0
    best_p = -1.0
    best_p_idx = 0
    w_max = 0.0
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        mask = offs < V
        p = tl.load(probs_ptr + row * V + offs, mask=mask, other=0.0)
        e = tl.load(noise_ptr + b.to(tl.int64) * V + offs, mask=mask, other=1.0)
        if HAS_Q:
            q = tl.sum(tl.where(ids[None, :] == offs[:, None], qp[None, :], 0.0), axis=1)
        else:
            q = tl.where(offs == x_rej, 1.0, 0.0)
        w = tl.maximum(p - q, 0.0)
        w_max = tl.maximum(w_max, tl.max(w, axis=0))
        rw = tl.where(mask, tl.math.div_rn(w, e), -1.0)
        m, j = tl.max(rw, axis=0, return_indices=True, return_indices_tie_break_left=True)
        best_w_idx = tl.where(m > best_w, v0 + j, best_w_idx)
        best_w = tl.maximum(best_w, m)
        rp = tl.where(mask, tl.math.div_rn(p, e), -1.0)
        m, j = tl.max(rp, axis=0, return_indices=True, return_indices_tie_break_left=True)
        best_p_idx = tl.where(m > best_p, v0 + j, best_p_idx)
        best_p = tl.maximum(best_p, m)
    token = tl.where(w_max > 0, best_w_idx, best_p_idx)
    tl.store(out_ptr + b * out_stride + n_acc, token.to(tl.int64))
    tl.store(num_acc_ptr + b, n_acc)


def rejection_sample_triton(
    target_probs: torch.Tensor,  # [N + B, V] float32, after temperature/top-k/top-p/min-p
    target_argmax: torch.Tensor,  # [N + B] int64, the greedy token of each target row
    draft_token_ids: torch.Tensor,  # [N] int64
    num_draft: torch.Tensor,  # [B] int64
    cu_num_draft: torch.Tensor,  # [B + 1] int64, cu[0] = 0
    draft_q_ids: torch.Tensor | None,  # [N, Kq] int64, -1 padded, unique; None: q = one-hot
    draft_q_probs: torch.Tensor | None,  # [N, Kq] float32, 0 padded
    is_greedy: torch.Tensor,  # [B] bool
    uniforms: torch.Tensor | None,  # [N] float32 in [0, 1); None only for an all-greedy strict batch
    noise: torch.Tensor | None,  # [B, V] float32 Exp(1); None only for an all-greedy batch
    max_num_draft: int,  # >= num_draft.max(); output width is max_num_draft + 1
    all_greedy: bool,
    mode: int = STRICT,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
    synthetic_acceptance_rate: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [B, max_num_draft + 1] (-1 padded), num_accepted [B]
    B, V = num_draft.shape[0], target_probs.shape[1]
    dev = target_probs.device
    out = torch.full((B, max_num_draft + 1), -1, dtype=torch.long, device=dev)
    num_acc = torch.zeros(B, dtype=torch.long, device=dev)
    if B == 0:
        return out, num_acc
    target_probs, cu_num_draft = target_probs.contiguous(), cu_num_draft.contiguous()
    dummy = draft_token_ids  # stands in for absent optional pointers; never read
    uniforms = dummy if uniforms is None else uniforms.contiguous()
    _greedy_kernel[(B,)](
        out, num_acc, cu_num_draft, draft_token_ids, target_argmax.contiguous(), is_greedy, uniforms,
        out.stride(0), float(synthetic_acceptance_rate), ALL_GREEDY=all_greedy, MODE=mode)
    if all_greedy:
        return out, num_acc
    has_q = draft_q_ids is not None
    kq = draft_q_ids.shape[1] if has_q else 1
    _random_kernel[(B,)](
        out, num_acc, cu_num_draft, draft_token_ids, target_probs,
        draft_q_ids.contiguous() if has_q else dummy, draft_q_probs.contiguous() if has_q else dummy,
        is_greedy, uniforms, noise.contiguous(),
        out.stride(0), V, kq, float(posterior_threshold), float(posterior_alpha),
        float(synthetic_acceptance_rate),
        MODE=mode, HAS_Q=has_q, BLOCK_V=min(triton.next_power_of_2(V), 1024),
        BLOCK_K=triton.next_power_of_2(max(kq, 1)))
    return out, num_acc
