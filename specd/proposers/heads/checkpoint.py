"""Reading head checkpoints and the few target tensors a head borrows.

A head directory holds a config.json and its tensors as *.safetensors, or as torch pickles
(*.bin / *.pt: the original EAGLE and Medusa releases), read with weights_only=True so a
checkpoint can carry tensors and nothing executable. The target's embeddings and LM head come
from its own directory (a local dir, a hub id or a GGUF file, resolved as the engine does).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from specd.engine.model.config import ModelArchConfig

# transformers' LlamaConfig defaults: a speculators config stores its transformer_layer_config
# with to_diff_dict(), which drops every value equal to these (Llama's; other families' differ).
_LLAMA_DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-6,
                       rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu")
_ARCH_BY_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}


def resolve_head_dir(model: str) -> Path:
    """A local directory, or a hub id fetched with the files heads are published as."""
    from specd.engine.loader import hub_snapshot

    path = Path(model).expanduser()
    if path.is_dir():
        return path
    return hub_snapshot(model, "head checkpoint", ["*.json", "*.safetensors", "*.bin", "*.pt"])


def read_config(head_dir: Path) -> dict:
    path = head_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"head checkpoint {head_dir} has no config.json")
    return json.loads(path.read_text())


def read_tensors(head_dir: Path, names: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint (files named in `names` first when present, else all
    *.safetensors, else all *.bin/*.pt), on the CPU."""
    files = [head_dir / n for n in names if (head_dir / n).is_file()]
    files = files or sorted(head_dir.glob("*.safetensors")) or sorted(
        [*head_dir.glob("*.bin"), *head_dir.glob("*.pt")])
    if not files:
        raise FileNotFoundError(f"no *.safetensors, *.bin or *.pt weights in {head_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        if file.suffix == ".safetensors":
            with safe_open(str(file), framework="pt", device="cpu") as f:
                tensors.update({k: f.get_tensor(k) for k in f.keys()})
        else:
            state = torch.load(file, map_location="cpu", weights_only=True)
            if not isinstance(state, dict):
                raise ValueError(f"{file}: expected a state dict of tensors")
            tensors.update({k: v for k, v in state.items() if isinstance(v, torch.Tensor)})
    return tensors


def strip_prefix(tensors: dict[str, torch.Tensor], *prefixes: str) -> dict[str, torch.Tensor]:
    """Names without the first of `prefixes` they start with (checkpoints nest heads differently)."""
    out = {}
    for name, t in tensors.items():
        for p in prefixes:
            if name.startswith(p):
                name = name[len(p):]
                break
        out[name] = t
    return out


def layer_arch(cfg: dict) -> ModelArchConfig:
    """The decoder-layer settings of a head's config (a Llama-family config.json, or a speculators
    transformer_layer_config with its defaults dropped)."""
    cfg = {**_LLAMA_DEFAULTS, **cfg}  # a full config.json has them all: nothing changes
    arch = _ARCH_BY_TYPE.get(cfg.get("model_type", "llama"), "LlamaForCausalLM")
    return ModelArchConfig.from_hf({**cfg, "architectures": [arch]})


@dataclass
class TargetPieces:
    """What a head borrows from the target: its shape, and the embeddings / LM head when asked."""
    arch: ModelArchConfig
    embed_tokens: torch.Tensor | None  # [V, H]
    lm_head: torch.Tensor | None  # [V, H]
    dir: Path | None = None  # the target's directory (its tokenizer: drafts masked by a grammar)


def load_target_pieces(target: str, embed: bool, lm_head: bool) -> TargetPieces:
    from specd.engine.loader import _weight_files, read_arch_config, resolve_model_dir

    target_dir = resolve_model_dir(target)
    arch = read_arch_config(target_dir)
    wanted = set()
    if embed or (lm_head and arch.tie_word_embeddings):
        wanted.add("model.embed_tokens.weight")
    if lm_head and not arch.tie_word_embeddings:
        wanted.add("lm_head.weight")
    found: dict[str, torch.Tensor] = {}
    if wanted:
        for file in _weight_files(target_dir):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                found.update({k: f.get_tensor(k) for k in f.keys() if k in wanted})
        missing = sorted(wanted - set(found))
        if missing:
            raise ValueError(f"target {target}: no {', '.join(missing)} in its weights")
    emb = found.get("model.embed_tokens.weight")
    head = (emb if arch.tie_word_embeddings else found.get("lm_head.weight")) if lm_head else None
    return TargetPieces(arch, emb if embed else None, head, Path(target_dir))


def take(tensors: dict[str, torch.Tensor], name: str, shape: tuple[int, ...] | None = None,
         where: str = "checkpoint") -> torch.Tensor:
    """tensors[name], with a clear error when it is missing or has the wrong shape."""
    if name not in tensors:
        raise ValueError(f"{where}: missing tensor {name!r}")
    t = tensors[name]
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{where}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    return t



def draft_to_target(tensors: dict[str, torch.Tensor], draft_vocab: int, vocab: int, where: str) -> torch.Tensor:
    """[draft_vocab] the target id of each draft index: from `d2t` offsets when the checkpoint has
    them (EAGLE-3's convention: target id = draft id + d2t[draft id]), else the identity."""
    ids = torch.arange(draft_vocab)
    if "d2t" in tensors:
        ids = ids + take(tensors, "d2t", (draft_vocab,), where).long()
    elif draft_vocab != vocab:
        raise ValueError(f"{where}: a draft vocabulary of {draft_vocab} ids needs d2t")
    if ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(f"{where}: d2t maps draft ids outside the target vocabulary [0, {vocab})")
    return ids
