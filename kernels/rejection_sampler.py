"""Batched rejection sampling for speculative decoding (DESIGN §4): the public entry point.

`rejection_sample` verifies the drafts of a whole flattened ragged batch in one call and
returns, per sequence, its accepted drafts followed by one recovered or bonus token:
  accepted   a draft token the target keeps: x_i with probability min(1, p_i(x_i)/q_i(x_i)),
             in order, stopping at the first rejection (greedy rows: iff x_i == argmax p_i);
  recovered  the token emitted in place of the first rejected draft, drawn from
             norm(max(0, p_i - q_i)) (greedy rows: argmax p_i);
  bonus      the extra token drawn from the target's next distribution when every draft of
             the sequence was accepted (greedy rows: its argmax).
In the default "strict" mode the emitted tokens follow the target distribution exactly, for
any draft distribution q. "typical" (Medusa's entropy threshold) and "synthetic" (a fixed
acceptance rate, for benchmarking) are opt-in, lossy, and reported as such in the output.

Layout: sequence b owns drafts [cu[b], cu[b+1]) of the N-long draft arrays and the k_b + 1
target rows [cu[b] + b, cu[b+1] + b] — its draft positions, then its bonus position, which
is the order a verify forward of [last token, x_1..x_k] produces logits in.

Dispatch: the Triton kernel for CUDA tensors when Triton is importable, the PyTorch
reference otherwise; SPECD_FORCE_TRITON=1 forces the kernel (for TRITON_INTERPRET=1 on CPU).
Randomness is drawn outside, by `draw_randomness`, from per-request generators. No host
sync happens here when the caller passes `max_num_draft` and `all_greedy` (host-side
metadata it already has); `to_token_lists` is the one place that moves results to the host.
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple, Sequence

import torch

from specd.kernels.rejection_sampler_ref import STRICT, SYNTHETIC, TYPICAL, rejection_sample_ref

MODES = {"strict": STRICT, "typical": TYPICAL, "synthetic": SYNTHETIC}


class RejectionSampleOutput(NamedTuple):
    # [B, max_num_draft + 1] int64: accepted drafts, then the recovered or bonus token, -1 padded
    output_token_ids: torch.Tensor
    num_accepted: torch.Tensor  # [B] int64: accepted drafts per sequence (emitted = num_accepted + 1)
    lossy: bool  # True when a lossy mode (typical, synthetic) decided acceptance


@functools.cache
def _triton_impl():
    try:
        from specd.kernels.rejection_sampler_triton import rejection_sample_triton
    except ImportError:  # Triton is optional: the CPU path never needs it
        return None
    return rejection_sample_triton


def backend(device: torch.device | str) -> str:
    """"triton" or "reference": which implementation `rejection_sample` uses for tensors on device."""
    wants = torch.device(device).type == "cuda" or os.environ.get("SPECD_FORCE_TRITON") == "1"
    return "triton" if wants and _triton_impl() is not None else "reference"


def rejection_sample(
    target_probs: torch.Tensor,  # [N + B, V] float32, processed target distribution (see layout)
    draft_token_ids: torch.Tensor,  # [N] int64
    num_draft: torch.Tensor,  # [B] int64, may contain 0
    draft_q_ids: torch.Tensor | None,  # [N, Kq] int64, unique ids, -1 padded; None: q = one-hot(draft)
    draft_q_probs: torch.Tensor | None,  # [N, Kq] float32, 0 padded (ids outside the set have q = 0)
    is_greedy: torch.Tensor,  # [B] bool: temperature-0 rows
    uniforms: torch.Tensor | None,  # [N] float32 U[0, 1) for the accept tests
    noise: torch.Tensor | None,  # [B, V] float32 Exp(1) for the one recovered-or-bonus draw
    *,
    cu_num_draft: torch.Tensor | None = None,  # [B + 1] int64, [0, cumsum(num_draft)]; None: computed
    target_argmax: torch.Tensor | None = None,  # [N + B] int64 greedy tokens; default from logits/probs
    target_logits: torch.Tensor | None = None,  # [N + B, V] raw logits: target_argmax = their argmax
    max_num_draft: int | None = None,  # host-side max(num_draft); computed (a sync) if None
    all_greedy: bool | None = None,  # host-side; True skips the random path entirely
    mode: str = "strict",
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
    synthetic_acceptance_rate: float = 1.0,
) -> RejectionSampleOutput:
    """Accept or reject every draft of the batch; see the module docstring.

    Greedy rows use `target_argmax`, else the argmax of `target_logits`, else of
    `target_probs` (pass the raw logits to match non-speculative greedy decoding exactly:
    softmax can round two close logits to one probability). "typical" changes the accept
    test of random rows only; "synthetic" accepts each draft of every row (greedy ones too)
    when its uniform < synthetic_acceptance_rate. In both lossy modes the replacement after
    a rejection is drawn from p (argmax for greedy rows). uniforms may be None for an
    all-greedy batch outside synthetic mode, noise for any all-greedy batch.
    """
    if mode not in MODES:
        raise ValueError(f"unknown rejection sample mode {mode!r}; expected one of {', '.join(MODES)}")
    if mode == "synthetic" and not 0.0 <= synthetic_acceptance_rate <= 1.0:
        raise ValueError(f"synthetic_acceptance_rate must be in [0, 1], got {synthetic_acceptance_rate}")
    if (draft_q_ids is None) != (draft_q_probs is None):
        raise ValueError("draft_q_ids and draft_q_probs go together (both, or neither for one-hot q)")
    if max_num_draft is None:
        max_num_draft = int(num_draft.max()) if num_draft.numel() else 0
    if all_greedy is None:
        # On the GPU this would be a sync: run both paths instead (still correct).
        all_greedy = bool(is_greedy.all()) if is_greedy.device.type == "cpu" else False
    if cu_num_draft is None:
        cu_num_draft = cu_num_draft_of(num_draft)
    if target_argmax is None:
        target_argmax = (target_logits if target_logits is not None else target_probs).argmax(dim=-1)
    impl = _triton_impl() if backend(target_probs.device) == "triton" else rejection_sample_ref
    out, num_accepted = impl(
        target_probs, target_argmax, draft_token_ids, num_draft, cu_num_draft, draft_q_ids,
        draft_q_probs, is_greedy, uniforms, noise, max_num_draft, all_greedy, MODES[mode],
        posterior_threshold, posterior_alpha, synthetic_acceptance_rate)
    return RejectionSampleOutput(out, num_accepted, mode != "strict")


def draw_randomness(
    generators: Sequence[torch.Generator | None],  # [B] per-request seeded generators; None: unseeded
    num_draft: Sequence[int],  # [B] host-side draft counts
    vocab: int,
    device: torch.device | str,
    default_generator: torch.Generator | None = None,  # for unseeded rows (engine-wide)
) -> tuple[torch.Tensor, torch.Tensor]:  # uniforms [N] float32, noise [B, V] float32
    """The randomness one rejection_sample call consumes, drawn outside the kernel.

    A seeded row draws its num_draft uniforms, then its vocab exponentials, from its own
    generator, so its result does not depend on what else is in the batch. Unseeded rows
    share one vectorised draw from default_generator. Generators must live on `device`.
    """
    n = sum(num_draft)
    uniforms = torch.rand(n, device=device, generator=default_generator)
    noise = torch.empty(len(num_draft), vocab, device=device).exponential_(generator=default_generator)
    start = 0
    for b, (gen, k) in enumerate(zip(generators, num_draft)):
        if gen is not None:
            uniforms[start:start + k] = torch.rand(k, device=device, generator=gen)
            noise[b].exponential_(generator=gen)
        start += k
    # E = 0 would divide by zero in the race; it has probability ~0 and no effect on the law.
    return uniforms, noise.clamp_min_(torch.finfo(torch.float32).tiny)


def cu_num_draft_of(num_draft: torch.Tensor) -> torch.Tensor:  # [B] -> [B + 1] int64
    return torch.nn.functional.pad(torch.cumsum(num_draft, 0), (1, 0))


def to_token_lists(output_token_ids: torch.Tensor) -> list[list[int]]:
    """[B, max_num_draft + 1] -1 padded → the emitted tokens of each sequence (host side)."""
    return [[t for t in row if t >= 0] for row in output_token_ids.tolist()]
