"""Training an EAGLE head for a target (the EAGLE-1 recipe, on the target's own answers).

The head reads pairs (the target's final normed state f_j at position j, the embedding of
token j+1): fc over their concatenation, then one Llama decoder layer, whose output at pair j
is its prediction of f_{j+1}; the target's LM head turns a prediction into draft logits. At
serving time later pairs carry the head's own predictions instead of f, so training adds noise
to f. Loss, as in EAGLE: smooth-L1 to f_{j+1} (in units of the states' standard deviation)
plus 0.1 x cross-entropy to the target's distribution at j+1 (its LM head applied to
f_{j+1}), both over the draft vocabulary the head will score. The decoder layer starts from
the target's last layer with its output projections zeroed (the head starts as "the next
state is this one"); the embeddings and LM head are the target's, frozen, and not saved.

The checkpoint is written in the yuhuili/EAGLE layout (config.json + fc.* + layers.0.*, layer
0 without input_layernorm), which specd's `eagle` proposer and EAGLE's own code both load,
with the target's weights fingerprint (specd/engine/model/fingerprint.py) in config.json.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# shared with the other heads' trainers (and imported from here by name)
from specd_train.drafter.head_training import acceptance, d2t, draft_vocabulary, target_features  # noqa: F401
from specd_train.drafter.head_training import train as train_loop
from specd_train.drafter.head_training import write_checkpoint
from specd_train.drafter import precision


@dataclass(frozen=True)
class EagleConfig:
    epochs: int = 3
    batch_tokens: int = 4096
    lr: float = 1e-3
    warmup: int = 20
    cls_weight: float = 0.1  # EAGLE's weight of the classification loss (regression: 1)
    noise: float = 0.2  # feature noise, in units of the features' standard deviation x 0.1
    init_layer: int = -1  # the target layer the head's decoder layer starts from
    prompt_weight: float = 0.25  # prompt positions count less than answer positions
    # The LM head scores only the most frequent answer tokens (0: all): on a 135M target the
    # shared 49,152-row head would be most of a draft's cost. Serving-time only (d2t in the checkpoint).
    draft_vocab: int = 16384
    seed: int = 0


class EagleTrainHead(nn.Module):
    """fc + one transformers LlamaDecoderLayer (no input norm), batched with padding."""

    def __init__(self, target, cfg: EagleConfig, draft_ids: torch.Tensor | None = None):
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        super().__init__()
        tc = target.config
        h = tc.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=True)
        with torch.no_grad():  # start as "the layer reads the feature": fc = [small | identity]
            self.fc.weight.zero_()
            self.fc.weight[:, h:] = torch.eye(h)
            self.fc.bias.zero_()
        tc._attn_implementation = "sdpa"
        self.layer = LlamaDecoderLayer(tc, 0)
        self.layer.load_state_dict(target.model.layers[cfg.init_layer].state_dict())
        self.layer.input_layernorm = nn.Identity()
        with torch.no_grad():  # residual branches start at zero: the head starts as "next state = this one"
            self.layer.self_attn.o_proj.weight.zero_()
            self.layer.mlp.down_proj.weight.zero_()
        self.rotary = LlamaRotaryEmbedding(tc)
        self.register_buffer("embed", target.model.embed_tokens.weight.detach().float(), persistent=False)
        lm_head = target.lm_head.weight.detach().float()
        # Scored over the draft vocabulary only, as at serving time (and 3x cheaper at 16k of 49k ids).
        self.register_buffer("lm_head", lm_head if draft_ids is None else lm_head[draft_ids], persistent=False)

    def forward(self, tokens: torch.Tensor, feats: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] (token j+1 of each pair), feats [B, T, H] (f_j), mask [B, T] -> [B, T, H]."""
        x = self.fc(torch.cat([self.embed[tokens], feats], dim=-1))
        T = x.shape[1]
        pos = torch.arange(T)[None]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        attn = (causal[None] & mask.bool()[:, None, :])[:, None]  # [B, 1, T, T]; padded keys never seen
        attn[..., 0] = True  # fully padded rows would see nothing: NaN-free, and never in the loss
        out = self.layer(x, attention_mask=attn, position_ids=pos, position_embeddings=self.rotary(x, pos))
        return out[0] if isinstance(out, tuple) else out

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.lm_head.T

    def state_for_checkpoint(self) -> dict[str, torch.Tensor]:
        """yuhuili/EAGLE names: fc.*, layers.0.* (no input_layernorm), bfloat16."""
        state = {f"fc.{k}": v for k, v in self.fc.state_dict().items()}
        state.update({f"layers.0.{k}": v for k, v in self.layer.state_dict().items()})
        return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in state.items()}


def _loss(head: EagleTrainHead, seqs, feats, prompt_lens, batch: list[int], cfg: EagleConfig, std: float,
          gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, top-1 agreement with the target) over the batch's pairs."""
    T = max(len(seqs[i]) for i in batch) - 1
    B, H = len(batch), feats[batch[0]].shape[1]
    tokens = torch.zeros(B, T, dtype=torch.long)
    inp = torch.zeros(B, T, H)
    goal = torch.zeros(B, T, H)
    weight = torch.zeros(B, T)
    for b, i in enumerate(batch):
        n = len(seqs[i]) - 1
        tokens[b, :n] = seqs[i][1:]
        inp[b, :n] = feats[i][:-1].float()
        goal[b, :n] = feats[i][1:].float()
        weight[b, :n] = cfg.prompt_weight
        weight[b, max(prompt_lens[i] - 2, 0): n] = 1.0  # pairs whose prediction is an answer token's state
    if gen is not None and cfg.noise:
        inp = inp + torch.randn(inp.shape, generator=gen) * (0.1 * cfg.noise * std)
    valid = weight > 0
    with precision.autocast():
        h = head(tokens, inp, valid.long())[valid].float()
        logq = F.log_softmax(head.logits(h).float(), dim=-1)
        with torch.no_grad():
            p = F.softmax(head.logits(goal[valid]).float(), dim=-1)
    w = weight[valid]
    reg = F.smooth_l1_loss(h / std, goal[valid] / std, reduction="none").mean(-1)  # in units of the states' std
    ce = -(p * logq).sum(-1)
    loss = ((reg + cfg.cls_weight * ce) * w).sum() / w.sum()
    agree = (logq.argmax(-1) == p.argmax(-1)).float().mean()
    return loss, agree


def train(head: EagleTrainHead, seqs, feats, prompt_lens, cfg: EagleConfig, log=print) -> dict:
    std = float(torch.cat([f[:64].float() for f in feats[:256]]).std())
    return train_loop(head, lambda batch, noise_gen: _loss(head, seqs, feats, prompt_lens, batch, cfg, std, noise_gen),
                      [len(s) for s in seqs], cfg, log)


def save(head: EagleTrainHead, target, out, fingerprint: str, cfg: EagleConfig,
         draft_ids: torch.Tensor | None = None) -> None:
    from dataclasses import asdict

    state = head.state_for_checkpoint()
    if draft_ids is not None:  # EAGLE-3's convention: target id = draft id + d2t[draft id]
        state["d2t"] = d2t(draft_ids)
    config = target.config.to_dict()
    config.update(num_hidden_layers=1, architectures=["LlamaForCausalLM"], torch_dtype="bfloat16",
                  specd_target_fingerprint=fingerprint, specd_eagle={"recipe": "EAGLE-1", **asdict(cfg)})
    config.pop("dtype", None)
    write_checkpoint(out, "model.safetensors", state, config)


def train_eagle(target_dir, out, args, log=print) -> dict:
    """The whole run: answers (cached, shared with the draft_model recipe) -> features -> train
    -> held-out acceptance through the serving proposer -> checkpoint + eval.json."""
    import json

    from transformers import AutoModelForCausalLM

    from specd.models.chat import chat_prompt_ids
    from specd.engine.loader import load_model, read_arch_config
    from specd.proposers.hidden_state import HiddenStateProposer
    from specd.models.tokenizer import Tokenizer
    from specd_train.drafter.answers import cached_answers, training_answers
    from specd_train.workloads import WORKLOADS, workload

    t0 = time.perf_counter()
    cfg = EagleConfig(**({"epochs": args.epochs} if args.epochs else {}))
    tok = Tokenizer.from_dir(target_dir)
    prompts, seqs = training_answers(target_dir, args, log)
    prompt_lens = [len(chat_prompt_ids(tok, m)) for m in prompts]
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).eval()
    feats = target_features(target, seqs, log)
    heldout = {}
    for name in WORKLOADS:
        msgs = workload(name, args.eval_prompts)
        hs = cached_answers(target_dir, msgs, args, log, greedy_only=True, dtype="float32")
        heldout[name] = (hs, target_features(target, hs, log), [len(chat_prompt_ids(tok, m)) for m in msgs])
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    arch = read_arch_config(target_dir)
    draft_ids = draft_vocabulary(seqs, prompt_lens, cfg.draft_vocab, arch.vocab_size)
    head = EagleTrainHead(target, cfg, draft_ids)
    report = train(head, seqs, feats, prompt_lens, cfg, log)
    fingerprint = load_model(target_dir, arch, torch.float32, torch.device("cpu"), 64, False).fingerprint
    save(head, target, out, fingerprint, cfg, draft_ids)
    proposer = HiddenStateProposer("eagle", str(out), str(target_dir), num_speculative_tokens=8, dtype="float32",
                                   device="cpu")
    evals = {name: {k: acceptance(proposer, *data, k) for k in (1, 2, 4, 6)} for name, data in heldout.items()}
    result = {"train": {**report, "prompts": len(prompts), "tokens": sum(len(s) for s in seqs),
                        "wall_s_total": time.perf_counter() - t0, "precision": precision.label()},
              "heldout": evals, "config": {k: v for k, v in vars(cfg).items()}}
    (out / "eval.json").write_text(json.dumps(result, indent=1) + "\n")
    from specd_train.drafter.eagle_card import finish

    finish(target_dir, out, args.threads, f"specd train-drafter --method eagle --threads {args.threads} "
           f"--prompts {args.prompts} --questions {args.questions} --out {out}")
    for name, by_k in evals.items():
        a = by_k[4]
        log(f"{name}: k=4 alpha per position {[round(x, 3) for x in a['alpha_per_position']]}, "
            f"tokens/step {a['tokens_per_step']:.2f}")
    return result
