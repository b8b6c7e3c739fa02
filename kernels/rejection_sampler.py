"""Batched rejection sampling for speculative decoding (docs/architecture.md, "Speculation"): the public
entry point.

`rejection_sample` verifies the drafts of a whole flattened ragged batch in one call and
returns, per sequence, its accepted drafts followed by one recovered or bonus token:
  accepted   a draft token the target keeps: x_i with probability min(1, p_i(x_i)/q_i(x_i)),
             in order, stopping at the first rejection (greedy rows: iff x_i == argmax p_i);
  recovered  the token emitted in place of the first rejected draft, drawn from
             norm(max(0, p_i - q_i)) (greedy rows: argmax p_i);
  bonus      the token after the last draft when every draft was accepted. It is not drawn
             here: the target sampler (specd.engine.sampler) draws it from the target's
             next distribution and passes it in, as in vLLM v1.
In the default "strict" mode the emitted tokens follow the target distribution exactly, for
any draft distribution q. "typical" (Medusa's entropy threshold) and "synthetic" (a fixed
acceptance rate, for benchmarking) are opt-in, lossy, and reported as such in the output.

Layout (SpecDecodeMetadata): sequence b owns drafts [cu[b], cu[b+1]) of the N-long draft
arrays, and the target rows passed in are those of the draft positions, in the same order.

Dispatch: the Triton kernel for CUDA tensors when Triton is importable, the PyTorch
reference otherwise; SPECD_FORCE_TRITON=1 forces the kernel (for TRITON_INTERPRET=1 on CPU).
Randomness is drawn outside, by `draw_randomness`, once per step. No host sync happens
here (the metadata carries its host-side values); `to_token_lists` is the one place that
moves results to the host.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from specd.kernels.rejection_sampler_ref import (MODES, STRICT, SYNTHETIC, TYPICAL, draw_from, exponential_race,
                                                inverse_cdf, rejection_sample_ref)

__all__ = ["MODES", "STRICT", "SYNTHETIC", "TYPICAL", "SpecDecodeMetadata", "RejectionSampleOutput",
           "rejection_sample", "draw_randomness", "draw_from", "exp_noise", "exponential_race", "inverse_cdf",
           "target_rows", "cu_num_draft_of", "to_token_lists"]


@dataclass
class SpecDecodeMetadata:
    """The drafts of one step, flattened over its B sampled sequences (N drafts in all)."""

    draft_token_ids: torch.Tensor  # [N] int64
    num_draft: torch.Tensor  # [B] int64, may contain 0
    cu_num_draft: torch.Tensor  # [B + 1] int64: [0, cumsum(num_draft)]
    num_draft_host: list[int]  # [B] the same counts, host side (randomness, row indices)
    max_num_draft: int  # host-side max(num_draft); output width is max_num_draft + 1
    is_greedy: torch.Tensor  # [B] bool: temperature-0 sequences
    all_greedy: bool  # host side: True skips the random path entirely
    draft_q_ids: torch.Tensor | None = None  # [N, Kq] int64, unique ids, -1 padded; None: q one-hot
    draft_q_probs: torch.Tensor | None = None  # [N, Kq] float32, 0 padded
    mode: str = "strict"
    posterior_threshold: float = 0.09  # typical mode
    posterior_alpha: float = 0.3  # typical mode
    synthetic_acceptance_rate: float = 1.0  # synthetic mode
    # Token trees (kernels/tree_rejection_sampler.py), host side: per sequence, the parent of each
    # draft (-1: the root), or None for a chain; None: every sequence is a chain.
    parents: list[list[int] | None] | None = None

    @property
    def has_tree(self) -> bool:
        return self.parents is not None and any(p is not None for p in self.parents)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown rejection sample mode {self.mode!r}; expected one of {', '.join(MODES)}")
        if self.mode == "synthetic" and not 0.0 <= self.synthetic_acceptance_rate <= 1.0:
            raise ValueError(f"synthetic_acceptance_rate must be in [0, 1], got {self.synthetic_acceptance_rate}")
        if (self.draft_q_ids is None) != (self.draft_q_probs is None):
            raise ValueError("draft_q_ids and draft_q_probs go together (both, or neither for one-hot q)")
        if self.has_tree and self.mode != "strict":
            raise ValueError("token trees are verified in strict mode only")

    @classmethod
    def build(cls, drafts: Sequence[Sequence[int]], is_greedy: Sequence[bool], device: torch.device | str,
              draft_q: Sequence[Sequence[tuple[Sequence[int], Sequence[float]]] | None] | None = None,
              parents: Sequence[Sequence[int] | None] | None = None, **mode) -> SpecDecodeMetadata:
        """From host lists: drafts per sequence, and optionally a sparse q per draft
        ((ids, probs) per position; None for a sequence whose drafts are deterministic) and
        the parent of each draft of a token tree (None for a chain)."""
        num_draft = [len(d) for d in drafts]
        q_ids = q_probs = None
        if draft_q is not None and any(draft_q):
            q_ids, q_probs = _sparse_q(drafts, draft_q)
        nd = torch.tensor(num_draft, dtype=torch.long)
        return cls(
            draft_token_ids=torch.tensor([t for d in drafts for t in d], dtype=torch.long, device=device),
            num_draft=nd.to(device), cu_num_draft=cu_num_draft_of(nd).to(device), num_draft_host=num_draft,
            max_num_draft=max(num_draft, default=0),
            is_greedy=torch.tensor(list(is_greedy), dtype=torch.bool, device=device), all_greedy=all(is_greedy),
            draft_q_ids=None if q_ids is None else q_ids.to(device),
            draft_q_probs=None if q_probs is None else q_probs.to(device),
            parents=[None if p is None else list(p) for p in parents] if parents is not None and any(
                p is not None for p in parents) else None, **mode)


def _sparse_q(drafts, draft_q) -> tuple[torch.Tensor, torch.Tensor]:  # [N, Kq] ids (-1 padded), probs
    width = max(len(ids) for q in draft_q if q for ids, _ in q)
    n = sum(len(d) for d in drafts)
    q_ids = torch.full((n, width), -1, dtype=torch.long)
    q_probs = torch.zeros((n, width), dtype=torch.float32)
    row = 0
    for d, q in zip(drafts, draft_q):
        for i, t in enumerate(d):
            ids, probs = q[i] if q else ([t], [1.0])
            q_ids[row, : len(ids)] = torch.tensor(ids)
            q_probs[row, : len(ids)] = torch.tensor(probs, dtype=torch.float32)
            row += 1
    return q_ids, q_probs


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
    meta: SpecDecodeMetadata,
    target_probs: torch.Tensor | None,  # [N, V] float32, filtered target distribution at each draft
    target_argmax: torch.Tensor,  # [N] int64 greedy token at each draft (argmax of the raw logits)
    bonus_token_ids: torch.Tensor,  # [B] int64, from the target sampler
    uniforms: torch.Tensor | None,  # [N] float32 U[0, 1) for the accept tests
    noise: torch.Tensor | None,  # what the bonus tokens were drawn with: [B, V] Exp(1) rows or [B] uniforms
) -> RejectionSampleOutput:
    """Accept or reject every draft of the batch; see the module docstring.

    Greedy rows use target_argmax (pass the raw logits' argmax to match non-speculative
    greedy decoding exactly: softmax can round two close logits to one probability).
    "typical" changes the accept test of random rows only; "synthetic" accepts each draft
    of every row (greedy ones too) when its uniform < synthetic_acceptance_rate. In both
    lossy modes the replacement after a rejection is drawn from p (argmax for greedy rows).
    target_probs and noise may be None for an all-greedy batch, uniforms too outside synthetic mode.
    """
    impl = _triton_impl() if backend(bonus_token_ids.device) == "triton" else rejection_sample_ref
    out, num_accepted = impl(meta, target_probs, target_argmax, bonus_token_ids, uniforms, noise)
    return RejectionSampleOutput(out, num_accepted, meta.mode != "strict")


def draw_randomness(
    generators: Sequence[torch.Generator | None],  # [B] per-request seeded generators; None: unseeded
    num_draft: Sequence[int],  # [B] host-side draft counts
    vocab: int,
    device: torch.device | str,
    default_generator: torch.Generator | None = None,  # for unseeded rows (engine-wide)
    draws: Sequence[bool] | None = None,  # [B] which sequences draw at all; None: every one
    race: bool | None = None,  # noise rows for the exponential race; None: where the Triton kernel runs
) -> tuple[torch.Tensor, torch.Tensor]:  # uniforms [N] float32, noise [B, V] float32 or [B] float64
    """Every random number one step consumes, drawn once, outside the samplers.

    A seeded row draws its num_draft uniforms, then its drawing randomness, from its own
    generator, so its result does not depend on what else is in the batch. Unseeded rows
    share one vectorised draw from default_generator (all their uniforms, then all their
    drawing randomness). The drawing randomness serves both the bonus draw and the recovered
    draw (only one is emitted; draw_from): with race, a row of vocab Exp(1) draws (the Triton
    kernel's exponential race, cheap on a GPU); otherwise one float64 uniform, for the inverse
    CDF (on a CPU a 49k-wide noise row cost ~0.8 ms a drafting sequence, 20% of a batch-8 step
    with drafts at T > 0 on the 2-core EPYC). Rows that do not draw get uniforms 0 and noise 1
    or uniform 0 (never read). Generators must live on `device`.
    """
    B, n = len(num_draft), sum(num_draft)
    draws = [True] * B if draws is None else list(draws)
    race = backend(device) == "triton" if race is None else race

    def drawing(shape: tuple[int, ...], generator: torch.Generator | None) -> torch.Tensor:
        if race:
            return exp_noise(shape + (vocab,), device, generator)
        return torch.rand(shape, dtype=torch.float64, device=device, generator=generator)
    starts = [0] * B
    for b in range(1, B):
        starts[b] = starts[b - 1] + num_draft[b - 1]
    shared = [b for b in range(B) if draws[b] and generators[b] is None]
    if len(shared) == B:  # the common case: no scatter
        uniforms = torch.rand(n, device=device, generator=default_generator)
        noise = drawing((B,), default_generator)
    else:
        uniforms = torch.zeros(n, device=device)
        noise = torch.ones(B, vocab, device=device) if race else torch.zeros(B, dtype=torch.float64, device=device)
        if shared:
            pos = [starts[b] + i for b in shared for i in range(num_draft[b])]
            if pos:
                uniforms[torch.tensor(pos, device=device)] = torch.rand(
                    len(pos), device=device, generator=default_generator)
            noise[torch.tensor(shared, device=device)] = drawing((len(shared),), default_generator)
    for b, (gen, k) in enumerate(zip(generators, num_draft)):
        if gen is not None and draws[b]:
            uniforms[starts[b]:starts[b] + k] = torch.rand(k, device=device, generator=gen)
            noise[b] = drawing((), gen)
    if not race:
        return uniforms, noise
    # E = 0 has probability ~0 and no effect on the law, but p / E with p = 0 would be NaN,
    # which argmax picks: a token the filters removed. Clamped, p = 0 gives 0.
    return uniforms, noise.clamp_min_(torch.finfo(torch.float32).tiny)


def exp_noise(shape: tuple[int, ...], device: torch.device | str, generator: torch.Generator | None) -> torch.Tensor:
    """Exp(1) draws, float32, from generator. On a CPU as -log(U) with U uniform in float64 (53
    bits: U = 0, E = inf, has probability 2^-53 a draw and only makes that token lose the race;
    float32's 24 bits would give E = 0, a sure win, to ~0.3% of 49k-token rows): PyTorch's
    exponential_ took 35 ms for the [32, 49152] noise of a batch-32 step at T > 0 on the 2-core
    EPYC, 23% of the step, this ~19 ms. Elsewhere exponential_ (a GPU draws it fast)."""
    if torch.device(device).type != "cpu":
        return torch.empty(shape, device=device).exponential_(generator=generator)
    return torch.rand(shape, dtype=torch.float64, device=device, generator=generator).log_().neg_().float()


def target_rows(num_draft: Sequence[int]) -> tuple[list[int], list[int]]:
    """Host-side row indices into a verify forward's logits [N + B, V], where sequence b has
    its k_b draft positions, then its last position: (draft rows [N], bonus rows [B])."""
    draft_rows, bonus_rows, r = [], [], 0
    for k in num_draft:
        draft_rows.extend(range(r, r + k))
        bonus_rows.append(r + k)
        r += k + 1
    return draft_rows, bonus_rows


def cu_num_draft_of(num_draft: torch.Tensor) -> torch.Tensor:  # [B] -> [B + 1] int64
    return torch.nn.functional.pad(torch.cumsum(num_draft, 0), (1, 0))


def to_token_lists(output_token_ids: torch.Tensor) -> list[list[int]]:
    """[B, max_num_draft + 1] -1 padded → the emitted tokens of each sequence (host side)."""
    return [[t for t in row if t >= 0] for row in output_token_ids.tolist()]
