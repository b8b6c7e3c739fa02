"""Is sampled output the target's? A test against target-only sampling, position by position.

Every sampled token after the first is turned into u = F(x-) + V·p(x) under the target's own
distribution at its position (p from transformers in float32, teacher-forced on the sequence;
F the cumulative distribution over token ids; V uniform). If every token follows the target
given its prefix, the u are independent uniforms (randomized probability integral transform),
so a chi-square test of their histogram against flat tests the whole output at once.
"""
from __future__ import annotations

import torch
from chi2 import chi2_critical

BINS = 20


def pit_values(target, prompts: list[list[int]], outputs: list[list[int]]) -> torch.Tensor:
    """u = F(x-) + V·p(x) for every output token after the first, p the target's float32
    distribution at that position (temperature 1, nothing filtered)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1234)
    out = []
    groups: dict[int, list[tuple[list[int], list[int]]]] = {}
    for prompt, ids in zip(prompts, outputs):
        groups.setdefault(len(prompt), []).append((prompt, ids))
    with torch.inference_mode():
        for n_prompt, items in groups.items():
            for start in range(0, len(items), 8):
                batch = items[start:start + 8]
                seqs = torch.tensor([p + ids for p, ids in batch])
                logits = model(seqs).logits[:, n_prompt:-1].float()  # rows predicting output tokens 1..
                probs = logits.softmax(-1)
                x = seqs[:, n_prompt + 1:]
                cdf_before = probs.cumsum(-1).gather(-1, x[..., None])[..., 0] - probs.gather(-1, x[..., None])[..., 0]
                p_x = probs.gather(-1, x[..., None])[..., 0]
                out.append((cdf_before + torch.rand(p_x.shape, generator=gen) * p_x).flatten())
    return torch.cat(out).clamp(0, 1 - 1e-9)


def chi2_uniform(u: torch.Tensor) -> tuple[float, float]:
    counts = torch.bincount((u * BINS).long(), minlength=BINS).double()
    expected = u.numel() / BINS
    return float(((counts - expected) ** 2 / expected).sum()), chi2_critical(BINS - 1)
