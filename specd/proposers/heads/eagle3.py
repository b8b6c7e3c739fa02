"""EAGLE-3 heads: fc over the target's 3 concatenated layers, a first layer whose attention
reads concat(norm(embedding), norm(hidden)) (2H wide), its own norm and LM head over a reduced
draft vocabulary mapped to target ids by d2t.

Layouts read:
- yuhuili/EAGLE3-* (SafeAILab/EAGLE, eagle/traineagle3/cnets.py `Model` and
  `LlamaDecoderLayeremb`): a Llama config.json with `draft_vocab_size` (and optionally
  `target_hidden_size`); `fc.weight` [H, 3 * H_target], `midlayer.*` (input_layernorm on the
  embeddings, hidden_norm on the hidden state, q/k/v_proj [., 2H]), `norm.weight`,
  `lm_head.weight` [V_draft, H], `d2t` [V_draft] (target id = draft id + d2t[draft id]), `t2d`.
- the speculators format (vllm-project/speculators, speculators_model_type "eagle3",
  src/speculators/models/eagle3/): `layers.{i}.*` (layer 0 as above, further layers plain),
  options norm_before_residual, eagle_aux_hidden_state_layer_ids, norm_before_fc (`input_norm`),
  fc_norm (`fc_norm.{j}`), norm_output; `embed_tokens.weight` when saved.
The target's embeddings are used where the checkpoint has none.
"""
from __future__ import annotations

import torch
from torch import nn

from specd.engine.model.decoder import RMSNorm
from specd.engine.model.rotary import RotaryEmbedding
from specd.proposers.heads.checkpoint import TargetPieces, draft_to_target, layer_arch, take
from specd.proposers.heads.layer import DecoderHead, HeadLayer, KVCache, advance, positions


class Eagle3Head(DecoderHead):
    def __init__(self, cfg: dict, opts: dict, num_aux: int, target_hidden: int, draft_vocab: int,
                 num_layers: int, max_positions: int):
        super().__init__()
        self.arch = arch = layer_arch(cfg)
        h, eps = arch.hidden_size, arch.rms_norm_eps
        self.norm_before_residual = bool(opts.get("norm_before_residual", False))
        self.norm_output = bool(opts.get("norm_output", False))
        self.input_norm = RMSNorm(num_aux * target_hidden, eps) if opts.get("norm_before_fc") else None
        self.fc_norm = nn.ModuleList(RMSNorm(target_hidden, eps) for _ in range(num_aux)) \
            if opts.get("fc_norm") else None
        self.fc = nn.Linear(num_aux * target_hidden, h, bias=False)
        self.hidden_norm = RMSNorm(h, eps)
        self.layers = nn.ModuleList(HeadLayer(arch, in_dim=2 * h if i == 0 else None) for i in range(num_layers))
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)
        self.rotary = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling)
        self.max_positions = max_positions
        self.register_buffer("embed_tokens", torch.empty(0), persistent=False)  # [V, H]
        self.token_ids: torch.Tensor | None = None  # [V_draft] draft index -> target id

    @property
    def feature_dim(self) -> int:
        return self.fc.in_features

    def forward(self, kvs: list[KVCache], counts: list[int], tokens: torch.Tensor, hidden: torch.Tensor,
                from_target: bool) -> torch.Tensor:
        """tokens [T] with hidden [T, 3 * H_target] (target features: through fc) or [T, H] (the
        head's own outputs, fed back as they are), rows grouped by sequence as counts says
        -> outputs [T, H]."""
        emb = self.embed_tokens[tokens]
        hidden = hidden.to(emb.dtype)
        if from_target:
            if self.input_norm is not None:
                hidden = self.input_norm.forward(hidden)
            if self.fc_norm is not None:
                chunks = hidden.chunk(len(self.fc_norm), -1)
                hidden = torch.cat([n.forward(c) for n, c in zip(self.fc_norm, chunks)], -1)
            hidden = self.fc.forward(hidden)
        cos_sin = self.rotary(positions(kvs, counts, emb.device))
        first = self.layers[0]
        normed = self.hidden_norm.forward(hidden)
        attn_in = torch.cat([first.input_layernorm.forward(emb), normed], dim=-1)
        x = first.forward(normed if self.norm_before_residual else hidden, cos_sin, kvs, counts, 0, attn_in=attn_in)
        for i, layer in enumerate(self.layers[1:], start=1):
            x = layer.forward(x, cos_sin, kvs, counts, i)
        advance(kvs, counts)
        return self.norm.forward(x) if self.norm_output else x

    def logits(self, out: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, V_draft] float32
        return self.lm_head.forward(out if self.norm_output else self.norm.forward(out)).float()


def load_eagle3(cfg: dict, tensors: dict[str, torch.Tensor], target: TargetPieces, num_aux: int,
                dtype: torch.dtype, device: torch.device, where: str) -> Eagle3Head:
    speculators = cfg.get("speculators_model_type") == "eagle3"
    layer_cfg = (cfg.get("transformer_layer_config") or {}) if speculators else cfg
    # yuhuili names its single layer midlayer.*; both keep hidden_norm inside the first layer
    tensors = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
               for k, v in tensors.items()}
    tensors = {("hidden_norm.weight" if k == "layers.0.hidden_norm.weight" else k): v for k, v in tensors.items()}
    lm_head = take(tensors, "lm_head.weight", where=where)
    draft_vocab = int(cfg.get("draft_vocab_size") or lm_head.shape[0])
    target_hidden = int(cfg.get("target_hidden_size") or target.arch.hidden_size)
    if target_hidden != target.arch.hidden_size:
        raise ValueError(f"{where}: trained for a target of hidden size {target_hidden}, "
                         f"this target has {target.arch.hidden_size}")
    num_layers = int(layer_cfg.get("num_hidden_layers", 1))
    max_positions = max(int(layer_cfg.get("max_position_embeddings", 2048)), target.arch.max_position_embeddings)
    with torch.device("meta"):
        head = Eagle3Head(layer_cfg, cfg, num_aux, target_hidden, draft_vocab, num_layers, max_positions)
    head = head.to_empty(device="cpu")
    h = head.arch.hidden_size
    head.fc.weight.data.copy_(take(tensors, "fc.weight", (h, num_aux * target_hidden), where))
    head.hidden_norm.weight.data.copy_(take(tensors, "hidden_norm.weight", (h,), where))
    for i, layer in enumerate(head.layers):
        layer.load(tensors, f"layers.{i}.", where)
    head.norm.weight.data.copy_(take(tensors, "norm.weight", (h,), where))
    head.lm_head.weight.data.copy_(take(tensors, "lm_head.weight", (draft_vocab, h), where))
    if head.input_norm is not None:
        head.input_norm.weight.data.copy_(take(tensors, "input_norm.weight", (num_aux * target_hidden,), where))
    for j, norm in enumerate(head.fc_norm or []):
        norm.weight.data.copy_(take(tensors, f"fc_norm.{j}.weight", (target_hidden,), where))
    head.embed_tokens = tensors.get("embed_tokens.weight", target.embed_tokens)
    if tuple(head.embed_tokens.shape) != (target.arch.vocab_size, h):
        raise ValueError(f"{where}: embeddings of shape {tuple(head.embed_tokens.shape)}, expected "
                         f"{(target.arch.vocab_size, h)} (the head's hidden size must be the target's)")
    head.token_ids = draft_to_target(tensors, draft_vocab, target.arch.vocab_size, where)
    head = head.to(device=device, dtype=dtype)
    head.token_ids = head.token_ids.to(device)
    head.rotary.build(device, dtype)
    return head.eval()

