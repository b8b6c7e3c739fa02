"""Batched rejection sampling in straight PyTorch: the reference and the CPU path.

Layout (flattened ragged batch): sequence b has k_b = num_draft[b] drafts at
draft_token_ids[cu[b] : cu[b+1]] and k_b + 1 target rows at target_probs[cu[b]+b :
cu[b+1]+b+1] — one per draft position, then its bonus position. Per sequence:
  accepted   draft x_i kept with probability min(1, p_i(x_i) / q_i(x_i)), in order, until
             the first rejection; greedy rows keep x_i iff x_i == argmax p_i;
  recovered  at the first rejected position i, the replacement drawn from
             norm(max(0, p_i - q_i)) (greedy: argmax p_i);
  bonus      when all k_b drafts are kept, one more token drawn from p_{k_b+1}.
So every sequence emits num_accepted + 1 tokens, distributed exactly as the target
alone for any q (Leviathan et al. 2023). Draws use the exponential race argmax(w / E),
E ~ Exp(1) passed in, so this is a deterministic function of its inputs.
"""
from __future__ import annotations

import torch

STRICT, TYPICAL, SYNTHETIC = 0, 1, 2


def rejection_sample_ref(
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
    B, N, dev = num_draft.shape[0], draft_token_ids.shape[0], target_probs.device
    K = max_num_draft if N else 0
    first_draft = cu_num_draft[:-1]  # [B]
    first_row = first_draft + torch.arange(B, device=dev)  # [B]
    pos = torch.arange(K, device=dev)  # [K]
    valid = pos[None, :] < num_draft[:, None]  # [B, K]
    d_idx = torch.where(valid, first_draft[:, None] + pos, 0)  # [B, K] index into the N arrays
    rows = torch.where(valid, first_row[:, None] + pos, 0)  # [B, K] index into the target rows
    x = draft_token_ids[d_idx]  # [B, K]
    out = torch.full((B, max_num_draft + 1), -1, dtype=torch.long, device=dev)

    def count_accepted(accept: torch.Tensor) -> torch.Tensor:  # [B, K] -> [B]: length of the kept prefix
        return (accept & valid).long().cumprod(dim=1).sum(dim=1)

    # Greedy path: accept iff the draft is the target's argmax; replacement and bonus = argmax.
    g_accept = uniforms[d_idx] < synthetic_acceptance_rate if mode == SYNTHETIC else x == target_argmax[rows]
    n_acc = count_accepted(g_accept)
    final = target_argmax[first_row + n_acc]  # [B]
    if not all_greedy:
        # Random path.
        p_x = target_probs[rows, x]  # [B, K]
        u = uniforms[d_idx]  # [B, K]
        if mode == STRICT:
            q_x = torch.ones_like(p_x) if draft_q_ids is None else (
                (draft_q_ids[d_idx] == x[..., None]) * draft_q_probs[d_idx]).sum(-1)
            r_accept = u * q_x < p_x  # u < min(1, p/q) without a division
        elif mode == TYPICAL:
            p = target_probs[rows]  # [B, K, V]
            entropy = -torch.where(p > 0, p * torch.log(p), 0.0).sum(-1)
            r_accept = p_x > torch.clamp(posterior_alpha * torch.exp(-entropy), max=posterior_threshold)
        else:
            r_accept = u < synthetic_acceptance_rate
        r_n_acc = count_accepted(r_accept)
        final_row = first_row + r_n_acc  # [B]
        p_final = target_probs[final_row]  # [B, V]
        q_dense = torch.zeros_like(p_final)  # q at the rejected position; 0 for a bonus draw
        if mode == STRICT and N:
            rejected = (r_n_acc < num_draft)[:, None]  # [B, 1]
            rej = (first_draft + r_n_acc).clamp(max=N - 1)  # [B]
            if draft_q_ids is None:
                q_dense.scatter_(1, draft_token_ids[rej][:, None], rejected.float())
            else:
                ids = draft_q_ids[rej]
                q_dense.scatter_add_(1, ids.clamp_min(0), draft_q_probs[rej] * ((ids >= 0) & rejected))
        w = torch.clamp_min(p_final - q_dense, 0.0)  # residual at a rejection, p for the bonus
        # Rounding can leave no residual mass where p == q on the support; p is then the answer.
        use_p = w.max(dim=-1, keepdim=True).values <= 0
        drawn = torch.where(use_p[:, 0], (p_final / noise).argmax(-1), (w / noise).argmax(-1))
        n_acc = torch.where(is_greedy, n_acc, r_n_acc)
        final = torch.where(is_greedy, final, drawn)
    out[:, :K] = torch.where(pos[None, :] < n_acc[:, None], x, -1)
    out.scatter_(1, n_acc[:, None], final[:, None])
    return out, n_acc
