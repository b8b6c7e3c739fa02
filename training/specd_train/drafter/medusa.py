"""Training Medusa heads for a target (Medusa-1: the target frozen, self-distillation on its answers).

Head a reads the target's final normed state f_j and drafts x_{j+2+a}, the token a + 1 places
after the one f_j predicts, in one pass with the other heads (parallel drafting). Each head is
a ResBlock x + SiLU(W x + b) started at the identity (W = 0, as Medusa initialises it), then
the target's own LM head, frozen and restricted to a draft vocabulary: a full 49,152-row
output layer per head would be most of a 135M target's cost and ~57 MB per head to ship.
Loss: cross-entropy to the target's distribution at j+1+a (its LM head on f_{j+1+a}) over the
draft vocabulary, head a weighted 0.8^a as in Medusa; answer positions weigh 1, prompt 0.25.

Saved in Medusa's layout (config.json with medusa_num_heads / medusa_num_layers,
medusa_lm_head.safetensors with `{a}.0.linear.weight|bias`) without the output layers:
`specd_lm_head: "target"` in config.json and the `d2t` draft-id offsets (EAGLE-3's convention)
tell specd's loader to take those rows of the target's LM head.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specd_train.drafter import head_training as ht
from specd_train.drafter import precision


@dataclass(frozen=True)
class MedusaConfig:
    num_heads: int = 4
    num_layers: int = 1
    epochs: int = 2
    batch_tokens: int = 4096
    lr: float = 1e-3
    warmup: int = 20
    decay: float = 0.8  # head a's loss weight: decay ** a
    prompt_weight: float = 0.25
    draft_vocab: int = 8192
    seed: int = 0


class MedusaTrainHeads(nn.Module):
    def __init__(self, lm_rows: torch.Tensor, cfg: MedusaConfig):
        super().__init__()
        h = lm_rows.shape[1]
        self.blocks = nn.ModuleList(nn.ModuleList(nn.Linear(h, h) for _ in range(cfg.num_layers))
                                    for _ in range(cfg.num_heads))
        with torch.no_grad():
            for block in self.blocks:
                for lin in block:
                    lin.weight.zero_()
        self.register_buffer("lm_rows", lm_rows.detach().float(), persistent=False)

    def head_logits(self, x: torch.Tensor, a: int) -> torch.Tensor:  # [N, H] -> [N, V_draft]
        for lin in self.blocks[a]:
            x = x + F.silu(lin(x))
        return x @ self.lm_rows.T

    def loss(self, seqs, final, prompt_lens, batch, cfg: MedusaConfig):
        inp, _, goal, w = ht.ahead_targets(seqs, final, prompt_lens, batch, cfg.num_heads - 1, cfg.prompt_weight)
        with precision.autocast():
            logits = [self.head_logits(inp, a) for a in range(cfg.num_heads)]
            return ht.ahead_loss(logits, goal, w, self.lm_rows, cfg.decay)

    def state_for_checkpoint(self) -> dict[str, torch.Tensor]:
        state = {f"{a}.{j}.linear.{n}": p for a, block in enumerate(self.blocks) for j, lin in enumerate(block)
                 for n, p in lin.named_parameters()}
        return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in state.items()}


def save(heads: MedusaTrainHeads, target_config, out, fingerprint: str, cfg: MedusaConfig,
         draft_ids: torch.Tensor | None) -> None:
    state = heads.state_for_checkpoint()
    if draft_ids is not None:
        state["d2t"] = ht.d2t(draft_ids)
    config = {"medusa_num_heads": cfg.num_heads, "medusa_num_layers": cfg.num_layers,
              "base_model_name_or_path": getattr(target_config, "_name_or_path", "") or "SmolLM2-135M-Instruct",
              "hidden_size": target_config.hidden_size, "vocab_size": target_config.vocab_size,
              "specd_lm_head": "target", "specd_target_fingerprint": fingerprint,
              "specd_medusa": {"recipe": "Medusa-1 self-distillation", **asdict(cfg)}}
    ht.write_checkpoint(out, "medusa_lm_head.safetensors", state, config)


def train_medusa(target_dir, out, args, log=print) -> dict:
    """The whole run: answers and features (cached) -> train -> checkpoint -> held-out acceptance."""
    import time

    from transformers import AutoConfig

    from specd_train.drafter.head_card import finish_head, lm_rows
    from specd.engine.loader import read_arch_config

    t0 = time.perf_counter()
    cfg = MedusaConfig(**({"epochs": args.epochs} if args.epochs else {}))
    data = ht.prepare(target_dir, args, log)
    seqs, final, pls = data["seqs"], data["final"], data["prompt_lens"]
    draft_ids = ht.draft_vocabulary(seqs, pls, cfg.draft_vocab, read_arch_config(target_dir).vocab_size)
    heads = MedusaTrainHeads(lm_rows(target_dir, draft_ids), cfg)
    report = ht.train(heads, lambda batch, _gen: heads.loss(seqs, final, pls, batch, cfg),
                      [len(s) for s in seqs], cfg, log)
    return finish_head("medusa", target_dir, out, args, data, report, cfg, t0,
                       lambda fp: save(heads, AutoConfig.from_pretrained(target_dir), out, fp, cfg, draft_ids), log)
