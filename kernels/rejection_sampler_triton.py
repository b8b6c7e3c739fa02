"""Batched rejection sampling as Triton kernels: same signature and results as
rejection_sampler_ref.rejection_sample_ref (see its docstring for the layout and for what
accepted, recovered and bonus tokens are).

One program per sequence; a greedy kernel and a random kernel, each skipping the
other's rows, and the random one not launched at all for an all-greedy batch. The
bonus token comes in from the target sampler; only a rejection draws, in one pass over
the vocabulary: an exponential race over the residual max(0, p - q) and, for the rare
all-zero residual, over p, kept side by side. Divisions are IEEE round-to-nearest
(div_rn) so results match the reference bit for bit.
Importing this module needs Triton; specd.kernels.rejection_sampler imports it lazily.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from specd.kernels.rejection_sampler_ref import MODES

if TYPE_CHECKING:
    from specd.kernels.rejection_sampler import SpecDecodeMetadata


@triton.jit
def _greedy_kernel(
    out_ptr, num_acc_ptr, cu_ptr, draft_ptr, target_argmax_ptr, bonus_ptr, is_greedy_ptr, uniforms_ptr,
    out_stride, rate,
    ALL_GREEDY: tl.constexpr, MODE: tl.constexpr,
):
    b = tl.program_id(0)
    if not ALL_GREEDY:
        if not tl.load(is_greedy_ptr + b):
            return
    start = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - start
    rejected = n < 0  # False, typed
    n_acc = n * 0
    for i in range(n):
        if not rejected:
            x = tl.load(draft_ptr + start + i)
            t = tl.load(target_argmax_ptr + start + i)
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
        tl.store(out_ptr + b * out_stride + n, tl.load(bonus_ptr + b))
    tl.store(num_acc_ptr + b, n_acc)


@triton.jit
def _random_kernel(
    out_ptr, num_acc_ptr, cu_ptr, draft_ptr, probs_ptr, bonus_ptr, q_ids_ptr, q_probs_ptr, is_greedy_ptr,
    uniforms_ptr, noise_ptr,
    out_stride, V, KQ, threshold, alpha, rate,
    MODE: tl.constexpr, HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0)
    if tl.load(is_greedy_ptr + b):
        return
    start = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - start
    k_offs = tl.arange(0, BLOCK_K)
    rejected = n < 0  # False, typed
    n_acc = n * 0
    for i in range(n):
        if not rejected:
            x = tl.load(draft_ptr + start + i)
            row = (start + i).to(tl.int64)
            p_x = tl.load(probs_ptr + row * V + x)
            if MODE == 0:  # STRICT (mode numbers as in the reference): accept w.p. min(1, p/q)
                q_x = 1.0
                if HAS_Q:
                    ids = tl.load(q_ids_ptr + row * KQ + k_offs, mask=k_offs < KQ, other=-1)
                    qp = tl.load(q_probs_ptr + row * KQ + k_offs, mask=k_offs < KQ, other=0.0)
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
    if rejected:
        # The recovered token, drawn from max(0, p - q) at the rejection (lossy modes: from p).
        row = (start + n_acc).to(tl.int64)
        x_rej = tl.load(draft_ptr + row)
        if HAS_Q:
            ids = tl.load(q_ids_ptr + row * KQ + k_offs, mask=k_offs < KQ, other=-1)
            qp = tl.load(q_probs_ptr + row * KQ + k_offs, mask=k_offs < KQ, other=0.0)
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
            if MODE == 0:
                if HAS_Q:
                    q = tl.sum(tl.where(ids[None, :] == offs[:, None], qp[None, :], 0.0), axis=1)
                else:
                    q = tl.where(offs == x_rej, 1.0, 0.0)
            else:
                q = tl.zeros([BLOCK_V], dtype=tl.float32)
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
    else:
        tl.store(out_ptr + b * out_stride + n, tl.load(bonus_ptr + b))
    tl.store(num_acc_ptr + b, n_acc)


def rejection_sample_triton(
    meta: SpecDecodeMetadata, target_probs: torch.Tensor | None, target_argmax: torch.Tensor,
    bonus_token_ids: torch.Tensor, uniforms: torch.Tensor | None, noise: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same arguments (shapes in its signature) and results as rejection_sample_ref."""
    B, dev = meta.num_draft.shape[0], bonus_token_ids.device
    mode = MODES[meta.mode]
    out = torch.full((B, meta.max_num_draft + 1), -1, dtype=torch.long, device=dev)
    num_acc = torch.zeros(B, dtype=torch.long, device=dev)
    if B == 0:
        return out, num_acc
    cu, drafts, bonus = meta.cu_num_draft.contiguous(), meta.draft_token_ids.contiguous(), bonus_token_ids.contiguous()
    dummy = bonus  # stands in for absent optional pointers; never read
    uniforms = dummy if uniforms is None else uniforms.contiguous()
    rate = float(meta.synthetic_acceptance_rate)
    _greedy_kernel[(B,)](
        out, num_acc, cu, drafts, target_argmax.contiguous(), bonus, meta.is_greedy, uniforms,
        out.stride(0), rate, ALL_GREEDY=meta.all_greedy, MODE=mode)
    if meta.all_greedy:
        return out, num_acc
    V = noise.shape[1]
    has_q = meta.draft_q_ids is not None
    kq = meta.draft_q_ids.shape[1] if has_q else 1
    _random_kernel[(B,)](
        out, num_acc, cu, drafts, target_probs.contiguous(), bonus,
        meta.draft_q_ids.contiguous() if has_q else dummy, meta.draft_q_probs.contiguous() if has_q else dummy,
        meta.is_greedy, uniforms, noise.contiguous(),
        out.stride(0), V, kq, float(meta.posterior_threshold), float(meta.posterior_alpha), rate,
        MODE=mode, HAS_Q=has_q, BLOCK_V=min(triton.next_power_of_2(V), 1024),
        BLOCK_K=triton.next_power_of_2(max(kq, 1)))
    return out, num_acc
