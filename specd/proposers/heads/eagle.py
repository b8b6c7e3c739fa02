"""EAGLE-1/2 heads (and HASS): fc over concat(embedding, feature), then Llama decoder layer(s);
the target's embeddings and LM head.

Layouts read:
- yuhuili/EAGLE-* (SafeAILab/EAGLE, eagle/model/cnets.py `Model`): a Llama config.json;
  `fc.weight` [H, 2H] (+ `fc.bias`), `layers.{i}.*` where layer 0 has no input_layernorm,
  optionally `embed_tokens.weight` (a frozen copy of the target's). EAGLE-2 reuses these weights.
- the speculators format (vllm-project/speculators, speculators_model_type "eagle", the legacy
  EagleSpeculator in convert/eagle/): `fusion_fc.*`, `transformer.*` (a single layer),
  `layernorms` adds `embedding_layernorm`, the layer's input_layernorm and
  `pre_lm_head_layernorm` (HASS), `fusion_bias` the fc bias. HASS's own names
  (`embed_layernorm`, `hidden_layernorm`, `lm_head_layernorm`) are mapped as its converter does.
specd's own heads may add `d2t` (EAGLE-3's draft-id -> target-id offsets): the LM head then
scores only those rows of the target's. Features: the target's final normed state (layer L). The head's output at a pair is its
prediction of the next feature; fed back with the drafted token, it drafts the next one.
"""
from __future__ import annotations

import torch
from torch import nn

from specd.engine.model.decoder import RMSNorm
from specd.engine.model.rotary import RotaryEmbedding
from specd.proposers.heads.checkpoint import TargetPieces, draft_to_target, layer_arch, take
from specd.proposers.heads.layer import DecoderHead, HeadLayer, KVCache, advance, positions

_SPECULATORS_NAMES = {"fusion_fc.": "fc.", "transformer.": "layers.0."}
_HASS_NAMES = {"embed_layernorm.weight": "embedding_layernorm.weight",
               "lm_head_layernorm.weight": "pre_lm_head_layernorm.weight",
               "hidden_layernorm.weight": "layers.0.input_layernorm.weight"}


class EagleHead(DecoderHead):
    def __init__(self, cfg: dict, layernorms: bool, fc_bias: bool, num_layers: int, max_positions: int):
        super().__init__()
        self.arch = arch = layer_arch(cfg)
        h = arch.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        self.layers = nn.ModuleList(HeadLayer(arch, input_norm=layernorms or i > 0) for i in range(num_layers))
        self.embedding_layernorm = RMSNorm(h, arch.rms_norm_eps) if layernorms else None
        self.pre_lm_head_layernorm = RMSNorm(h, arch.rms_norm_eps) if layernorms else None
        self.rotary = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling)
        self.max_positions = max_positions
        self.register_buffer("embed_tokens", torch.empty(0), persistent=False)  # [V, H]
        self.register_buffer("lm_head", torch.empty(0), persistent=False)  # [V, H]
        self.token_ids: torch.Tensor | None = None  # drafts are target ids already
        self.lm_head_linear: nn.Module | None = None  # lm_head through the engine's matmul, once loaded

    @property
    def feature_dim(self) -> int:
        return self.arch.hidden_size

    def forward(self, kvs: list[KVCache], counts: list[int], tokens: torch.Tensor, hidden: torch.Tensor,
                from_target: bool) -> torch.Tensor:
        """tokens [T], hidden [T, H] (target features, or the head's own outputs: EAGLE-1 treats
        both alike): counts[s] rows of sequence s in turn, each continuing its cache kvs[s]
        -> the head's outputs [T, H]."""
        emb = self.embed_tokens[tokens]
        if self.embedding_layernorm is not None:
            emb = self.embedding_layernorm.forward(emb)
        x = self.fc.forward(torch.cat([emb, hidden.to(emb.dtype)], dim=-1))
        cos_sin = self.rotary(positions(kvs, counts, x.device))
        for i, layer in enumerate(self.layers):
            x = layer.forward(x, cos_sin, kvs, counts, i)
        advance(kvs, counts)
        return x

    def logits(self, out: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, V] float32
        if self.pre_lm_head_layernorm is not None:
            out = self.pre_lm_head_layernorm.forward(out)
        if self.lm_head_linear is not None:
            return self.lm_head_linear(out).float()
        return (out @ self.lm_head.T).float()


def load_eagle(cfg: dict, tensors: dict[str, torch.Tensor], target: TargetPieces, dtype: torch.dtype,
               device: torch.device, where: str) -> EagleHead:
    if cfg.get("speculators_model_type") == "eagle":
        layer_cfg, layernorms = cfg.get("transformer_layer_config") or {}, bool(cfg.get("layernorms", False))
        tensors = _renamed(tensors, _SPECULATORS_NAMES)
        num_layers = 1
    else:
        layer_cfg = cfg
        tensors = {_HASS_NAMES.get(k, k): v for k, v in tensors.items()}
        layernorms = "embedding_layernorm.weight" in tensors
        num_layers = int(cfg.get("num_hidden_layers", 1))
    max_positions = max(int(layer_cfg.get("max_position_embeddings", 2048)), target.arch.max_position_embeddings)
    with torch.device("meta"):
        head = EagleHead(layer_cfg, layernorms, "fc.bias" in tensors, num_layers, max_positions)
    head = head.to_empty(device="cpu")
    h = head.arch.hidden_size
    if h != target.arch.hidden_size:
        raise ValueError(f"{where}: head hidden size {h} != the target's {target.arch.hidden_size}")
    head.fc.weight.data.copy_(take(tensors, "fc.weight", (h, 2 * h), where))
    if head.fc.bias is not None:
        head.fc.bias.data.copy_(take(tensors, "fc.bias", (h,), where))
    for i, layer in enumerate(head.layers):
        layer.load(tensors, f"layers.{i}.", where)
    for name in ("embedding_layernorm", "pre_lm_head_layernorm"):
        if getattr(head, name) is not None:
            getattr(head, name).weight.data.copy_(take(tensors, f"{name}.weight", (h,), where))
    # The checkpoint's copy of the embeddings when it ships one (what the head was trained with).
    head.embed_tokens = tensors.get("embed_tokens.weight", target.embed_tokens)
    head.lm_head = target.lm_head
    if "d2t" in tensors:
        # specd's extension (EAGLE-3's convention): score only a draft vocabulary, the rows d2t
        # names of the target's LM head. On a small target that head is most of a draft's cost.
        head.token_ids = draft_to_target(tensors, tensors["d2t"].shape[0], target.arch.vocab_size, where)
        head.lm_head = target.lm_head.index_select(0, head.token_ids).contiguous()
    if tuple(head.embed_tokens.shape) != (target.arch.vocab_size, h):
        raise ValueError(f"{where}: embeddings of shape {tuple(head.embed_tokens.shape)}, expected "
                         f"{(target.arch.vocab_size, h)}")
    head = head.to(device=device, dtype=dtype)
    if head.token_ids is not None:
        head.token_ids = head.token_ids.to(device)
    head.rotary.build(device, dtype)
    return head.eval()


def _renamed(tensors: dict[str, torch.Tensor], pieces: dict[str, str]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        for old, new in pieces.items():
            if name.startswith(old):
                name = new + name[len(old):]
                break
        out[name] = t
    return out
