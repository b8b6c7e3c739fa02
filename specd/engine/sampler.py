"""Next-token sampling for a batch: greedy, temperature, top-k, top-p, min-p, seeds.

Sampling uses the exponential race, argmax(p / E) with E ~ Exp(1), which draws
exactly from p without a host sync. Each seeded request draws its noise from its
own generator, so its tokens do not depend on what else is in the batch.
"""
from __future__ import annotations

import hashlib

import torch

from specd.sampling import SamplingParams


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def apply_sampling_filters(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on float32 logits [N, V] → probabilities [N, V]."""
    n, vocab = logits.shape
    dev = logits.device
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=dev)
    x = logits / temps[:, None]
    top_k = [p.top_k if p.top_k > 0 else vocab for p in params]
    top_p = [p.top_p for p in params]
    if any(k < vocab for k in top_k) or any(tp < 1.0 for tp in top_p):
        sorted_x, order = x.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=dev)[None, :]
        sorted_x = sorted_x.masked_fill(ranks >= torch.tensor(top_k, device=dev)[:, None], float("-inf"))
        probs_sorted = sorted_x.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
        sorted_x = sorted_x.masked_fill(mass_before > torch.tensor(top_p, device=dev)[:, None], float("-inf"))
        x = torch.empty_like(x).scatter_(-1, order, sorted_x)
    probs = x.softmax(dim=-1)
    min_p = torch.tensor([p.min_p for p in params], device=dev)
    if bool((min_p > 0).any()):
        keep = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs * keep
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        # Shared generator for unseeded requests: reproducible engine runs, batch-dependent draws.
        self.default_generator = make_generator(seed, device)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> list[int]:
        """logits [N, V] float32 → one token per row."""
        greedy = [p.greedy for p in params]
        tokens = logits.argmax(dim=-1)
        if not all(greedy):
            probs = apply_sampling_filters(logits, params)
            noise = torch.empty_like(probs)
            for i, (is_greedy, gen) in enumerate(zip(greedy, generators)):
                if not is_greedy:
                    noise[i].exponential_(generator=gen or self.default_generator)
            sampled = (probs / noise).argmax(dim=-1)
            tokens = torch.where(torch.tensor(greedy, device=logits.device), tokens, sampled)
        return tokens.tolist()


def draft_seed(seed: int, position: int) -> int:
    """The seed of the draft at `position` of a request seeded with `seed`.

    Keyed by position, not a stream per request: a resync rebuilds the drafter's state, and a
    stream restarted from the request seed would replay randomness that already drew drafts the
    verifier saw. A position is drafted again only when its earlier draft was never verified
    (an earlier draft was rejected), so its randomness shaped nothing committed. Hashed, so it
    is never the verifier's own stream for that seed (drafts correlated with the acceptance
    uniforms would break exactness)."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8, person=b"specd-draft").digest()
    return int.from_bytes(digest, "little") >> 1
