"""Batched rejection sampling, straight PyTorch: the reference (and the CPU path).

Per sequence b with drafts x_1..x_k (k = num_draft[b]) and target distributions
p_1..p_{k+1} (rows cu[b]+b .. cu[b]+b+k of target_probs; the last is the bonus row):
  accepted  x_i is kept with probability min(1, p_i(x_i) / q_i(x_i)), in order, until
            the first rejection (greedy rows: kept iff x_i == argmax p_i);
  recovered at the first rejected position i, a replacement drawn from
            norm(max(0, p_i − q_i)) (greedy: argmax p_i);
  bonus     when all k are kept, one more token drawn from p_{k+1}.
Every sequence emits num_accepted + 1 tokens, exactly distributed as the target
alone for any q (Leviathan et al. 2023). q is one-hot(x_i) for deterministic drafts,
or the sparse top-K distribution the drafter sampled from.
Draws use the exponential race argmax(w / E), E ~ Exp(1), with the randomness passed
in, so this is a deterministic function of its inputs.
"""
from __future__ import annotations

import torch


def rejection_sample_ref(
    target_probs: torch.Tensor,  # [N + B, V] float32, processed (temperature/top-k/top-p/min-p)
    target_argmax: torch.Tensor,  # [N + B] int64, argmax of the raw target logits (greedy rows)
    draft_token_ids: torch.Tensor,  # [N] int64
    num_draft: torch.Tensor,  # [B] int64
    draft_q_ids: torch.Tensor | None,  # [N, Kq] int64, -1 padded; None: q = one-hot(draft)
    draft_q_probs: torch.Tensor | None,  # [N, Kq] float32
    is_greedy: torch.Tensor,  # [B] bool
    uniforms: torch.Tensor,  # [N] float32 in [0, 1)
    noise: torch.Tensor,  # [B, V] float32, Exp(1)
    mode: int = 0,  # 0 strict, 1 typical, 2 synthetic
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
    synthetic_acceptance_rate: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [B, max_k + 1] (-1 padded), num_accepted [B]
    B, V = num_draft.shape[0], target_probs.shape[1]
    N = draft_token_ids.shape[0]
    K = int(num_draft.max()) if B else 0
    dev = target_probs.device
    cu = torch.cumsum(num_draft, 0) - num_draft  # [B] first draft of each sequence
    first_row = cu + torch.arange(B, device=dev)  # [B] first target row of each sequence
    pos = torch.arange(K, device=dev)
    valid = pos[None, :] < num_draft[:, None]  # [B, K]
    draft_idx = (cu[:, None] + pos).clamp(max=max(N - 1, 0))  # [B, K]
    rows = first_row[:, None] + pos  # [B, K]
    rows = torch.where(valid, rows, first_row[:, None])
    x = draft_token_ids[draft_idx] if N else torch.zeros(B, K, dtype=torch.long, device=dev)  # [B, K]
    p = target_probs[rows]  # [B, K, V]
    p_x = p.gather(-1, x[..., None])[..., 0]  # [B, K]
    if draft_q_ids is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = ((draft_q_ids[draft_idx] == x[..., None]) * draft_q_probs[draft_idx]).sum(-1)
    u = uniforms[draft_idx] if N else torch.zeros(B, K, device=dev)
    if mode == 0:
        accept = u * q_x < p_x  # u < min(1, p/q) without dividing
    elif mode == 1:
        entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
        accept = p_x > torch.minimum(torch.full_like(p_x, posterior_threshold),
                                     posterior_alpha * torch.exp(-entropy))
    else:
        accept = u < synthetic_acceptance_rate
    accept = torch.where(is_greedy[:, None], x == target_argmax[rows], accept) & valid
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B]
    # The one token drawn per sequence: recovered at the first rejection, or the bonus.
    final_row = first_row + num_accepted  # [B]
    p_final = target_probs[final_row]  # [B, V]
    rejected = num_accepted < num_draft
    q_dense = torch.zeros(B, V, device=dev)
    rej_draft = (cu + num_accepted).clamp(max=max(N - 1, 0))  # [B]
    if N:
        if draft_q_ids is None:
            q_dense.scatter_(1, draft_token_ids[rej_draft][:, None], 1.0)
        else:
            ids = draft_q_ids[rej_draft]
            q_dense.scatter_add_(1, ids.clamp_min(0), draft_q_probs[rej_draft] * (ids >= 0))
    residual = (p_final - q_dense).clamp_min(0) if mode == 0 else p_final
    residual = torch.where(rejected[:, None], residual, p_final)
    # Rounding can leave an all-zero residual where p == q; p itself is then the answer.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_final)
    drawn = (residual / noise).argmax(-1)
    final = torch.where(is_greedy, target_argmax[final_row], drawn)
    out = torch.full((B, K + 1), -1, dtype=torch.long, device=dev)
    out[:, :K] = torch.where(pos[None, :] < num_accepted[:, None], x, -1)
    out.scatter_(1, num_accepted[:, None], final[:, None])
    return out, num_accepted
