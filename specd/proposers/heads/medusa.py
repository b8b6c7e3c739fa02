"""Medusa heads: head i maps the target's last normed state h to logits of the token i + 1
places after the one h predicted: ResBlock(s) x + SiLU(W x + b), then a linear to the vocabulary.

Layout (FasterDecoding/Medusa, medusa/model/medusa_model.py `MedusaModel`): config.json with
`medusa_num_heads`, `medusa_num_layers` (and base_model_name_or_path); the weights are the
state dict of the `medusa_head` ModuleList, `{i}.{j}.linear.weight|bias` for the ResBlocks and
`{i}.{medusa_num_layers}.weight` for the vocabulary projection, in `medusa_lm_head.pt` (Medusa-1
releases) or `medusa_lm_head.safetensors`; Medusa-2 style full checkpoints prefix them with
`medusa_head.`. Medusa builds a head's ResBlocks as `[ResBlock(h)] * n`: one block repeated,
whose state dict lists it under every index, so loading per index reads it right either way.
specd's own heads (training/specd_train/drafter/medusa.py) store no output layers: `specd_lm_head:
"target"` in config.json shares the target's LM head, restricted to the draft vocabulary that
`d2t` names (EAGLE-3's offsets) when present.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specd.proposers.heads.checkpoint import draft_to_target, strip_prefix, take

FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


class MedusaHeads(nn.Module):
    def __init__(self, hidden: int, vocab: int, num_heads: int, num_layers: int):
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(num_layers))
                                    for _ in range(num_heads))
        self.out = nn.ModuleList(nn.Linear(hidden, vocab, bias=False) for _ in range(num_heads))
        self.max_k = num_heads
        self.feature_dim = hidden
        self.token_ids: torch.Tensor | None = None  # draft index -> target id (a draft vocabulary)

    def head_logits(self, rows: torch.Tensor, i: int) -> torch.Tensor:  # [B, H] -> [B, V] float32
        x = rows
        for lin in self.blocks[i]:
            x = x + F.silu(lin.forward(x))
        return self.out[i].forward(x).float()

    def draft(self, rows: torch.Tensor, last_tokens: list[int], ks: list[int], pick) -> None:
        """All drafts from one state per sequence (parallel drafting): head i's choice does not
        feed head i+1. rows [B, H]; sequence b gets ks[b] drafts, pick(b, i, logits [V])."""
        rows = rows.to(self.compute_dtype)
        for i in range(max(ks, default=0)):
            live = [b for b, k in enumerate(ks) if k > i]
            logits = self.head_logits(rows[live], i)
            for b, row in zip(live, logits):
                pick(b, i, row)


def load_medusa(cfg: dict, tensors: dict[str, torch.Tensor], hidden: int, vocab: int, dtype: torch.dtype,
                device: torch.device, where: str, target_lm_head: torch.Tensor | None = None) -> MedusaHeads:
    tensors = strip_prefix(tensors, "medusa_head.", "base_model.medusa_head.")
    num_heads = int(cfg.get("medusa_num_heads", 0))
    num_layers = int(cfg.get("medusa_num_layers", 1))
    if num_heads < 1:
        raise ValueError(f"{where}: config.json needs medusa_num_heads >= 1")
    shared = cfg.get("specd_lm_head") == "target"
    token_ids = draft_to_target(tensors, len(tensors["d2t"]), vocab, where) if shared and "d2t" in tensors else None
    heads = MedusaHeads(hidden, vocab if token_ids is None else len(token_ids), num_heads, num_layers)
    for i in range(num_heads):
        for j, lin in enumerate(heads.blocks[i]):
            lin.weight.data.copy_(take(tensors, f"{i}.{j}.linear.weight", (hidden, hidden), where))
            lin.bias.data.copy_(take(tensors, f"{i}.{j}.linear.bias", (hidden,), where))
        if shared:  # one module for every head: the target's rows are held once
            heads.out[i] = heads.out[0]
            if i == 0:
                rows = target_lm_head if token_ids is None else target_lm_head[token_ids]
                heads.out[0].weight.data.copy_(rows)
        else:
            heads.out[i].weight.data.copy_(take(tensors, f"{i}.{num_layers}.weight", (vocab, hidden), where))
    heads = heads.to(device=device, dtype=dtype).eval()
    heads.compute_dtype = dtype  # its linears may become the engine's modules (no .weight)
    heads.token_ids = None if token_ids is None else token_ids.to(device)
    return heads
