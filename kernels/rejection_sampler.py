"""Public entry point for batched rejection sampling (DESIGN §4).

Dispatches to the Triton kernel for CUDA tensors when Triton is installed, and to
the PyTorch reference otherwise. Lossy modes (typical, synthetic) are reported.
"""
from __future__ import annotations

import torch

from specd.kernels.rejection_sampler_ref import rejection_sample_ref

MODES = {"strict": 0, "typical": 1, "synthetic": 2}


def rejection_sample(
    target_probs: torch.Tensor,  # [N + B, V] processed target distribution per draft row + bonus row
    target_logits: torch.Tensor,  # [N + B, V] raw logits (greedy rows use their argmax)
    draft_token_ids: torch.Tensor,  # [N]
    num_draft: torch.Tensor,  # [B]
    draft_q_ids: torch.Tensor | None,  # [N, Kq] or None (deterministic drafts: q one-hot)
    draft_q_probs: torch.Tensor | None,  # [N, Kq]
    is_greedy: torch.Tensor,  # [B] bool
    uniforms: torch.Tensor,  # [N]
    noise: torch.Tensor,  # [B, V] Exp(1)
    mode: str = "strict",
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
    synthetic_acceptance_rate: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """→ (out [B, max_k + 1] padded with -1, num_accepted [B], lossy)."""
    if mode not in MODES:
        raise ValueError(f"unknown rejection sample mode {mode!r}; expected one of {', '.join(MODES)}")
    target_argmax = target_logits.argmax(dim=-1)
    out, num_accepted = rejection_sample_ref(
        target_probs, target_argmax, draft_token_ids, num_draft, draft_q_ids, draft_q_probs, is_greedy,
        uniforms, noise, MODES[mode], posterior_threshold, posterior_alpha, synthetic_acceptance_rate)
    return out, num_accepted, mode != "strict"
