"""Parse a Hugging Face config.json into the few numbers our Llama-family decoder needs."""
from __future__ import annotations

from dataclasses import dataclass, field

# architecture -> (default qkv bias, o_proj bias follows attention_bias, q/k RMSNorm)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": ("attention_bias", True, False),
    "MistralForCausalLM": ("attention_bias", True, False),
    "Qwen2ForCausalLM": ("always", False, False),
    "Qwen3ForCausalLM": ("attention_bias", True, True),
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class ModelArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope_theta: float
    rope_scaling: dict = field(default_factory=dict)  # rope_type + its parameters
    sliding_windows: list[int | None] = field(default_factory=list)  # per layer
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelArchConfig":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}; only 'silu' is supported")
        qkv_rule, o_follows, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        attention_bias = bool(cfg.get("attention_bias", False))
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        head_dim = cfg.get("head_dim") or hidden // num_heads
        rope = _rope_parameters(cfg)
        eos = cfg.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if qkv_rule == "always" else attention_bias,
            o_bias=attention_bias if o_follows else False,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=qk_norm,
            rope_theta=float(rope.pop("rope_theta")),
            rope_scaling=rope,
            sliding_windows=_sliding_windows(cfg, arch),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_list(eos),
        )


def _as_list(x) -> list[int]:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _rope_parameters(cfg: dict) -> dict:
    # transformers 5 writes "rope_parameters" (theta included); 4.x wrote
    # "rope_theta" plus an optional "rope_scaling". Accept both.
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if cfg.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    params["rope_type"] = rope_type
    return params


def _sliding_windows(cfg: dict, arch: str) -> list[int | None]:
    n, window = cfg["num_hidden_layers"], cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    if arch == "MistralForCausalLM" and window:
        return [window] * n
    if cfg.get("use_sliding_window") and window:
        first_full = cfg.get("max_window_layers", n)
        return [window if i >= first_full else None for i in range(n)]
    return [None] * n
