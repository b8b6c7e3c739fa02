"""Batched rejection sampling in straight PyTorch: the reference and the CPU path.

Layout (flattened ragged batch, see SpecDecodeMetadata): sequence b has k_b = num_draft[b]
drafts at draft_token_ids[cu[b] : cu[b+1]] and one target row per draft at the same indices
of target_probs / target_argmax (the target's distribution at that draft's position). Its
bonus token, the target sampler's token after its last draft, is passed in. Per sequence:
  accepted   draft x_i kept with probability min(1, p_i(x_i) / q_i(x_i)), in order, until
             the first rejection; greedy rows keep x_i iff x_i == argmax p_i;
  recovered  at the first rejected position i, the replacement drawn from
             norm(max(0, p_i - q_i)) (greedy: argmax p_i);
  bonus      when all k_b drafts are kept, bonus_token_ids[b].
So every sequence emits num_accepted + 1 tokens, distributed exactly as the target
alone for any q (Leviathan et al. 2023). The recovered draw uses the randomness the
sequence's bonus token was drawn with (one of the two is emitted): on a GPU the exponential
race argmax(w / E) on its noise row E ~ Exp(1) (no host sync, cheap there), on a CPU the
inverse CDF of the residual at its one uniform (a 49k-wide Exp(1) row cost ~0.8 ms a
sequence on the 2-core EPYC, the cumulative sum ~0.1 ms). So this is a deterministic
function of its inputs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specd.kernels.sampling_ops import inverse_cdf

if TYPE_CHECKING:
    from specd.kernels.rejection_sampler import SpecDecodeMetadata

STRICT, TYPICAL, SYNTHETIC = 0, 1, 2
MODES = {"strict": STRICT, "typical": TYPICAL, "synthetic": SYNTHETIC}


def exponential_race(weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:  # [B, V], [B, V] -> [B]
    """argmax(w / E), E ~ Exp(1): a draw from norm(w) without a host sync (gpt-fast). E > 0
    (draw_randomness clamps it), so a weight of 0 gives 0, never NaN, and is never drawn
    while any weight is positive."""
    return (weights / noise).argmax(dim=-1)


def draw_from(weights: torch.Tensor, randomness: torch.Tensor) -> torch.Tensor:  # [B, V], [B, V] | [B] -> [B]
    """A token per row from norm(weights) with a sequence's drawing randomness, as draw_randomness
    made it: [B, V] Exp(1) rows (the exponential race) or [B] uniforms (the inverse CDF)."""
    return exponential_race(weights, randomness) if randomness.dim() == 2 else inverse_cdf(weights, randomness)


def rejection_sample_ref(
    meta: SpecDecodeMetadata,
    target_probs: torch.Tensor | None,  # [N, V] float32, filtered; None only for an all-greedy batch
    target_argmax: torch.Tensor,  # [N] int64, the greedy token at each draft position
    bonus_token_ids: torch.Tensor,  # [B] int64, the target sampler's token after the last draft
    uniforms: torch.Tensor | None,  # [N] float32 in [0, 1); None only for an all-greedy strict batch
    noise: torch.Tensor | None,  # [B, V] float32 Exp(1) > 0, or [B] uniforms (draw_from); None: all greedy
) -> tuple[torch.Tensor, torch.Tensor]:  # out [B, max_num_draft + 1] (-1 padded), num_accepted [B]
    num_draft, draft_token_ids = meta.num_draft, meta.draft_token_ids
    mode, rate = MODES[meta.mode], meta.synthetic_acceptance_rate
    B, N, dev = num_draft.shape[0], draft_token_ids.shape[0], bonus_token_ids.device
    K = meta.max_num_draft if N else 0
    first = meta.cu_num_draft[:-1]  # [B]
    pos = torch.arange(K, device=dev)  # [K]
    valid = pos[None, :] < num_draft[:, None]  # [B, K]
    d_idx = torch.where(valid, first[:, None] + pos, 0)  # [B, K] index into the N arrays
    x = draft_token_ids[d_idx]  # [B, K]
    out = torch.full((B, meta.max_num_draft + 1), -1, dtype=torch.long, device=dev)
    if N == 0:  # nothing to verify: the bonus tokens are the output
        out[:, 0] = bonus_token_ids
        return out, torch.zeros(B, dtype=torch.long, device=dev)

    def count_accepted(accept: torch.Tensor) -> torch.Tensor:  # [B, K] -> [B]: length of the kept prefix
        return (accept & valid).long().cumprod(dim=1).sum(dim=1)

    # Greedy path: accept iff the draft is the target's argmax; the replacement is the argmax.
    g_accept = uniforms[d_idx] < rate if mode == SYNTHETIC else x == target_argmax[d_idx]
    n_acc = count_accepted(g_accept)
    rej = (first + n_acc).clamp(max=N - 1)  # [B] the first rejected draft (garbage when none)
    final = torch.where(n_acc < num_draft, target_argmax[rej], bonus_token_ids)  # [B]
    if not meta.all_greedy:
        # Random path.
        p_x = target_probs[d_idx, x]  # [B, K]
        u = uniforms[d_idx]  # [B, K]
        if mode == STRICT:
            q_x = torch.ones_like(p_x) if meta.draft_q_ids is None else (
                (meta.draft_q_ids[d_idx] == x[..., None]) * meta.draft_q_probs[d_idx]).sum(-1)
            r_accept = u * q_x < p_x  # u < min(1, p/q) without a division
        elif mode == TYPICAL:
            p = target_probs[d_idx]  # [B, K, V]
            entropy = -torch.where(p > 0, p * torch.log(p), 0.0).sum(-1)
            r_accept = p_x > torch.clamp(meta.posterior_alpha * torch.exp(-entropy), max=meta.posterior_threshold)
        else:
            r_accept = u < rate
        r_n_acc = count_accepted(r_accept)
        rejected = r_n_acc < num_draft  # [B]
        rej = (first + r_n_acc).clamp(max=N - 1)  # [B]
        p_rej = target_probs.index_select(0, rej)  # [B, V] (advanced indexing: ~10x slower on a CPU)
        if mode != STRICT:  # lossy modes: q = 0 at the rejected position, draw from p
            w = p_rej
        elif meta.draft_q_ids is None:  # one-hot q: max(p - q, 0) is p with the draft's entry 0 (p <= 1)
            w = p_rej.scatter(1, draft_token_ids[rej][:, None], 0.0)
        else:
            q_dense = torch.zeros_like(p_rej)
            ids = meta.draft_q_ids[rej]
            q_dense.scatter_add_(1, ids.clamp_min(0), meta.draft_q_probs[rej] * (ids >= 0))
            w = torch.clamp_min(p_rej - q_dense, 0.0)  # the residual
        # Rounding can leave no residual mass where p == q on the support; p is then the answer.
        use_p = w.max(dim=-1, keepdim=True).values <= 0
        recovered = draw_from(torch.where(use_p, p_rej, w), noise)
        drawn = torch.where(rejected, recovered, bonus_token_ids)
        n_acc = torch.where(meta.is_greedy, n_acc, r_n_acc)
        final = torch.where(meta.is_greedy, final, drawn)
    out[:, :K] = torch.where(pos[None, :] < n_acc[:, None], x, -1)
    out.scatter_(1, n_acc[:, None], final[:, None])
    return out, n_acc
