"""Sampled drafts, as the model drafters (draft_model, the hidden-state heads) draw them.

A request that samples gets drafts from the drafter's top-k truncated, renormalised distribution
at the request's temperature, and that sparse q ships with them so the verifier can accept
exactly; a greedy one gets the argmax (q one-hot, not shipped). A seeded request draws draft j
from a generator seeded by (request seed, position of j), so its drafts, and therefore its final
tokens, depend neither on the other sequences in the batch nor on resyncs; an unseeded one draws
from the drafter's own stream.
"""
from __future__ import annotations

import secrets

import torch

from specd.engine.sampler import draft_seed
from specd.proposers.base import ProposeRequest


class SampledDrafts:
    """Mixed into a model drafter, which sets self.device before calling _init_sampling."""

    device: torch.device

    def _init_sampling(self, sample_method: str, top_k: int, seed: int | None) -> None:
        """sample_method: "sampled" draws sampled requests' drafts, "greedy" drafts every request
        greedily. Unseeded requests draw from self.generator: random per process unless a seed is
        given (the offline engine passes one derived from its own, never equal to it)."""
        self.sample_method, self.top_k = sample_method, top_k
        self.generator = torch.Generator(device=self.device).manual_seed(
            secrets.randbits(63) if seed is None else seed)

    def _sampled(self, req: ProposeRequest) -> bool:
        return self.sample_method == "sampled" and (req.temperature or 0.0) > 0

    def _draft_generator(self, req: ProposeRequest, position: int) -> torch.Generator:
        """The stream a draft at `position` (committed tokens + drafts before it) draws from."""
        if req.seed is None:
            return self.generator
        return torch.Generator(device=self.device).manual_seed(draft_seed(req.seed, position))

    def _sample_sparse(self, logits: torch.Tensor, req: ProposeRequest, position: int):
        """logits [V] -> (the drawn index, the top-k indices, their probabilities q)."""
        top = (logits.float() / req.temperature).topk(min(self.top_k, logits.shape[-1]))
        probs = top.values.softmax(-1)
        choice = int(torch.multinomial(probs, 1, generator=self._draft_generator(req, position)))
        return int(top.indices[choice]), top.indices.tolist(), probs.tolist()
