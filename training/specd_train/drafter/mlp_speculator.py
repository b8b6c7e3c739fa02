"""Training an MLP speculator for a target (IBM's recipe, on the target's own answers).

Stage a mixes the running state with the embedding of the last token and drafts the next:
state <- GELU(LN_a(proj_a(state) + (emb_weight / state_weight) * emb(token))), logits from the
state; stage 0 starts from the target's final normed state f_j and the token x_{j+1} it
predicted, stage a + 1 reads stage a's token. Training is teacher-forced on the target's
answers (stage a reads x_{j+1+a}), as IBM's stage-1 recipe does, with cross-entropy to the
target's distribution at j+1+a over a draft vocabulary; answer positions weigh 1, prompt 0.25.

The token embeddings and the output layer are the target's own, frozen (the output layer
restricted to the draft vocabulary): IBM's checkpoints train a [vocab, inner] embedding and
head per stage, which for a 49,152-token vocabulary would be ~57 MB each to ship and most of
a 135M target's cost to run. Only proj_a and LN_a are trained (inner = the target's hidden
size). Saved in IBM's layout (config.json with emb_dim, inner_dim, n_predict, vocab_size;
`proj.{a}.weight`, `ln.{a}.weight|bias`) without `emb.*` and `head.*`: `specd_embeddings:
"target"`, `specd_lm_head: "target"` and `d2t` tell specd's loader where those come from.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specd.proposers.heads.mlp_speculator import _ln
from specd_train.drafter import head_training as ht
from specd_train.drafter import precision


@dataclass(frozen=True)
class MLPSpeculatorConfig:
    n_predict: int = 4
    epochs: int = 2
    batch_tokens: int = 4096
    lr: float = 1e-3
    warmup: int = 20
    decay: float = 0.8  # stage a's loss weight: decay ** a
    prompt_weight: float = 0.25
    draft_vocab: int = 8192
    seed: int = 0


class MLPSpeculatorTrain(nn.Module):
    def __init__(self, embed: torch.Tensor, lm_rows: torch.Tensor, cfg: MLPSpeculatorConfig):
        super().__init__()
        h, n = lm_rows.shape[1], cfg.n_predict
        self.proj = nn.ModuleList(nn.Linear(h, h, bias=False) for _ in range(n))
        with torch.no_grad():  # stage 0 starts by passing the target's state through
            self.proj[0].weight.copy_(torch.eye(h))
        self.ln_weight = nn.ParameterList(nn.Parameter(torch.ones(h)) for _ in range(n))
        self.ln_bias = nn.ParameterList(nn.Parameter(torch.zeros(h)) for _ in range(n))
        self.register_buffer("embed", embed.detach().float(), persistent=False)
        self.register_buffer("lm_rows", lm_rows.detach().float(), persistent=False)
        self.state_weight = 0.5 ** (0.5 / n)  # as IBM's MLPSpeculator and specd's loader
        self.emb_weight = math.sqrt((1 - self.state_weight ** 2) * (h / 2))

    def stage(self, state: torch.Tensor, tokens: torch.Tensor, a: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage a: state [N, H] and the token each row read [N] -> (new state, logits [N, V_draft])."""
        state = self.proj[a](state) + (self.emb_weight / self.state_weight) * self.embed[tokens]
        state = F.gelu(_ln(state, self.ln_weight[a], self.ln_bias[a]))
        return state, state @ self.lm_rows.T

    def stages(self, state: torch.Tensor, tokens: torch.Tensor) -> list[torch.Tensor]:
        """state [N, H], tokens [N, n_predict] (stage a reads tokens[:, a]) -> logits per stage."""
        out = []
        for a in range(len(self.proj)):
            state, logits = self.stage(state, tokens[:, a], a)
            out.append(logits)
        return out

    def loss(self, seqs, final, prompt_lens, batch, cfg: MLPSpeculatorConfig):
        inp, toks, goal, w = ht.ahead_targets(seqs, final, prompt_lens, batch, cfg.n_predict - 1, cfg.prompt_weight)
        with precision.autocast():
            return ht.ahead_loss(self.stages(inp, toks), goal, w, self.lm_rows, cfg.decay)

    def state_for_checkpoint(self) -> dict[str, torch.Tensor]:
        state = {f"proj.{a}.weight": p.weight for a, p in enumerate(self.proj)}
        state.update({f"ln.{a}.weight": w for a, w in enumerate(self.ln_weight)})
        state.update({f"ln.{a}.bias": b for a, b in enumerate(self.ln_bias)})
        return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in state.items()}


def save(spec: MLPSpeculatorTrain, target_config, out, fingerprint: str, cfg: MLPSpeculatorConfig,
         draft_ids: torch.Tensor | None) -> None:
    state = spec.state_for_checkpoint()
    if draft_ids is not None:
        state["d2t"] = ht.d2t(draft_ids)
    h = target_config.hidden_size
    config = {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator",
              "emb_dim": h, "inner_dim": h, "n_predict": cfg.n_predict, "vocab_size": target_config.vocab_size,
              "tie_weights": False, "scale_input": False, "top_k_tokens_per_head": [1] * cfg.n_predict,
              "specd_embeddings": "target", "specd_lm_head": "target", "specd_target_fingerprint": fingerprint,
              "specd_mlp_speculator": {"recipe": "IBM stage 1 (teacher-forced) on the target's answers",
                                       **asdict(cfg)}}
    ht.write_checkpoint(out, "model.safetensors", state, config)


def train_mlp_speculator(target_dir, out, args, log=print) -> dict:
    """The whole run: answers and features (cached) -> train -> checkpoint -> held-out acceptance."""
    import time

    from transformers import AutoConfig

    from specd.engine.loader import read_arch_config
    from specd.proposers.heads.checkpoint import load_target_pieces
    from specd_train.drafter.head_card import finish_head, lm_rows

    t0 = time.perf_counter()
    cfg = MLPSpeculatorConfig(**({"epochs": args.epochs} if args.epochs else {}))
    arch = read_arch_config(target_dir)
    data = ht.prepare(target_dir, args, log)
    seqs, final, pls = data["seqs"], data["final"], data["prompt_lens"]
    draft_ids = ht.draft_vocabulary(seqs, pls, cfg.draft_vocab, arch.vocab_size)
    embed = load_target_pieces(str(target_dir), embed=True, lm_head=False).embed_tokens
    spec = MLPSpeculatorTrain(embed, lm_rows(target_dir, draft_ids), cfg)
    report = ht.train(spec, lambda batch, _gen: spec.loss(seqs, final, pls, batch, cfg),
                      [len(s) for s in seqs], cfg, log)
    return finish_head("mlp_speculator", target_dir, out, args, data, report, cfg, t0,
                       lambda fp: save(spec, AutoConfig.from_pretrained(target_dir), out, fp, cfg, draft_ids), log)
