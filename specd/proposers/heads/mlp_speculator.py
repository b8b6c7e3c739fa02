"""IBM's MLP speculator (Wertheimer et al. 2024, "Accelerating Production LLMs with Combined
Token/Embedding Speculators"): stage i mixes the running state with the embedding of the last
token, state <- GELU(LN_i(proj_i(state) + (emb_weight / state_weight) * emb_i(token))), and
predicts with head_i; the drafted token feeds stage i + 1. No KV, no attention.

Layout (ibm-fms/* and ibm-granite/*-accelerator checkpoints; foundation-model-stack's
fms_extras MLPSpeculator, as loaded by vLLM's model_executor/models/mlp_speculator.py):
config.json with emb_dim (the target's hidden size), inner_dim (0: emb_dim), n_predict,
vocab_size, tie_weights, scale_input; tensors `emb.{i}.weight` [V, inner], `proj.{i}.weight`
(proj.0 [inner, emb_dim], others [inner, inner]), `head.{i}.weight` [V, inner],
`ln.{i}.weight|bias` (a bias-shifted RMS norm, eps 1e-6), optionally prefixed `speculator.`.
tie_weights shares emb/head/ln across stages and proj across stages 1..n-1 (the stage-0 and
stage-1 tensors are read). scale_input normalises the target state first (no weight) and
divides it by sqrt(2). state_weight = 0.5 ** (0.5 / n_predict), emb_weight =
sqrt((1 - state_weight^2) * inner / 2).
specd's own speculators (training/specd_train/drafter/mlp_speculator.py) store no `emb.*` or `head.*`:
`specd_embeddings: "target"` and `specd_lm_head: "target"` in config.json share the target's
embeddings and LM head (inner = emb_dim), the head restricted to the draft vocabulary that
`d2t` names (EAGLE-3's offsets) when present.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specd.proposers.heads.checkpoint import TargetPieces, draft_to_target, strip_prefix, take

_EPS = 1e-6


def _ln(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + _EPS)
    return x if weight is None else weight * x + bias


class MLPSpeculator(nn.Module):
    def __init__(self, emb_dim: int, inner_dim: int, vocab: int, n_predict: int, scale_input: bool,
                 head_vocab: int | None = None):
        super().__init__()
        self.emb = nn.ModuleList(nn.Embedding(vocab, inner_dim) for _ in range(n_predict))
        self.proj = nn.ModuleList(nn.Linear(emb_dim if i == 0 else inner_dim, inner_dim, bias=False)
                                  for i in range(n_predict))
        self.head = nn.ModuleList(nn.Linear(inner_dim, head_vocab or vocab, bias=False) for _ in range(n_predict))
        self.ln_weight = nn.ParameterList(nn.Parameter(torch.ones(inner_dim)) for _ in range(n_predict))
        self.ln_bias = nn.ParameterList(nn.Parameter(torch.zeros(inner_dim)) for _ in range(n_predict))
        self.scale_input = scale_input
        self.state_weight = 0.5 ** (0.5 / n_predict)
        self.emb_weight = math.sqrt((1 - self.state_weight ** 2) * (inner_dim / 2))
        self.max_k = n_predict
        self.feature_dim = emb_dim
        self.token_ids: torch.Tensor | None = None  # head index -> target id (a draft vocabulary)

    def draft(self, rows: torch.Tensor, last_tokens: list[int], ks: list[int], pick) -> None:
        """Drafts from one state per sequence in one pass: stage i reads stage i-1's state and
        drafted token. rows [B, emb_dim]; sequence b gets ks[b] drafts, pick(b, i, logits [V])."""
        state = rows.to(self.emb[0].weight.dtype)  # (the linears may be the engine's modules, without .weight)
        if self.scale_input:
            state = _ln(state) / math.sqrt(2)
        tokens = torch.tensor(last_tokens, device=state.device)
        for i in range(max(ks, default=0)):
            state = self.proj[i].forward(state) + (self.emb_weight / self.state_weight) * self.emb[i].weight[tokens]
            state = F.gelu(_ln(state, self.ln_weight[i], self.ln_bias[i]))
            logits = self.head[i].forward(state).float()  # [B, V]
            tokens = torch.tensor([pick(b, i, row) if ks[b] > i else 0 for b, row in enumerate(logits)],
                                  device=state.device)


def load_mlp_speculator(cfg: dict, tensors: dict[str, torch.Tensor], target: TargetPieces, dtype: torch.dtype,
                        device: torch.device, where: str) -> MLPSpeculator:
    tensors = strip_prefix(tensors, "speculator.")
    target_hidden, target_vocab = target.arch.hidden_size, target.arch.vocab_size
    emb_dim = int(cfg.get("emb_dim") or target_hidden)
    inner = int(cfg.get("inner_dim") or 0) or emb_dim
    vocab, n = int(cfg.get("vocab_size") or target_vocab), int(cfg.get("n_predict", 0))
    if n < 1:
        raise ValueError(f"{where}: config.json needs n_predict >= 1")
    if emb_dim != target_hidden or vocab != target_vocab:
        raise ValueError(f"{where}: built for hidden size {emb_dim} and {vocab} tokens; the target has "
                         f"{target_hidden} and {target_vocab}")
    shared_emb, shared_head = cfg.get("specd_embeddings") == "target", cfg.get("specd_lm_head") == "target"
    if (shared_emb or shared_head) and inner != emb_dim:
        raise ValueError(f"{where}: the target's embeddings and LM head need inner_dim = emb_dim ({emb_dim})")
    token_ids = draft_to_target(tensors, len(tensors["d2t"]), vocab, where) if shared_head and "d2t" in tensors \
        else None
    tied = bool(cfg.get("tie_weights", False))
    spec = MLPSpeculator(emb_dim, inner, vocab, n, bool(cfg.get("scale_input", False)),
                         None if token_ids is None else len(token_ids))
    for i in range(n):
        s = 0 if tied else i  # tied: one emb/head/ln for all stages
        p = min(i, 1) if tied else i  # tied: proj.0 from the target state, proj.1 for the rest
        spec.proj[i].weight.data.copy_(
            take(tensors, f"proj.{p}.weight", (inner, emb_dim if i == 0 else inner), where))
        spec.ln_weight[i].data.copy_(take(tensors, f"ln.{s}.weight", (inner,), where))
        spec.ln_bias[i].data.copy_(take(tensors, f"ln.{s}.bias", (inner,), where))
        if shared_emb:  # one module for every stage: the target's rows are held once
            spec.emb[i] = spec.emb[0]
        if i == 0 or not shared_emb:
            spec.emb[i].weight.data.copy_(target.embed_tokens if shared_emb else
                                          take(tensors, f"emb.{s}.weight", (vocab, inner), where))
        if shared_head:
            spec.head[i] = spec.head[0]
        if i == 0 or not shared_head:
            rows = None if not shared_head else \
                target.lm_head if token_ids is None else target.lm_head[token_ids]
            spec.head[i].weight.data.copy_(rows if shared_head else
                                           take(tensors, f"head.{s}.weight", (vocab, inner), where))
    spec = spec.to(device=device, dtype=dtype).eval()
    spec.token_ids = None if token_ids is None else token_ids.to(device)
    return spec
