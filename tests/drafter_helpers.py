"""Shared by the speculative and token-tree tests: a drafter near the target, a record of verified trees."""
from __future__ import annotations

import torch


def perturbed_copy(target: str, out, scale: float, seed: int = 0) -> str:
    """The target with seeded Gaussian noise on every weight, saved to out: a drafter that agrees
    with the target often, not always."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    model.save_pretrained(out)
    return str(out)


def record_tree_paths(llm) -> list[tuple[list[int] | None, list[int]]]:
    """Wrap the engine's sampler: (parents, accepted path) of every tree sequence verified."""
    seen, engine = [], llm.engine
    inner = engine.sampler

    class Recording:
        def __call__(self, logits, meta):
            out = inner(logits, meta)
            if out.paths is not None:
                for parents, path in zip(meta.spec.parents, out.paths):
                    seen.append((parents, path))
            return out

        def __getattr__(self, name):
            return getattr(inner, name)

    engine.sampler = Recording()
    return seen


def parallel_copy(drafter: str, out, pard_token: int, parallel_drafts: int | None = None) -> str:
    """drafter's directory with a PARD mask token in its config: the proposer then drafts a chain
    in one forward (the weights were not trained for it, so drafts past the first are guesses)."""
    import json
    import shutil

    shutil.copytree(drafter, out, dirs_exist_ok=True)
    config = json.loads((out / "config.json").read_text())
    config["pard_token"] = pard_token
    if parallel_drafts is not None:
        config["specd_drafter"] = {**config.get("specd_drafter", {}), "parallel_drafts": parallel_drafts}
    (out / "config.json").write_text(json.dumps(config))
    return str(out)
