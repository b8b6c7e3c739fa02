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
with the target's weights fingerprint (specd/engine/fingerprint.py) in config.json.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


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


@torch.inference_mode()
def target_features(target, sequences: list[torch.Tensor], log=print, batch: int = 8) -> list[torch.Tensor]:
    """The target's final normed hidden state at every position of each sequence, bfloat16."""
    out, t0, done = [], time.perf_counter(), 0
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))  # little padding per batch
    feats: dict[int, torch.Tensor] = {}
    for start in range(0, len(order), batch):
        idx = order[start:start + batch]
        n = max(len(sequences[i]) for i in idx)
        ids = torch.zeros(len(idx), n, dtype=torch.long)
        mask = torch.zeros(len(idx), n, dtype=torch.long)
        for b, i in enumerate(idx):
            ids[b, :len(sequences[i])] = sequences[i]
            mask[b, :len(sequences[i])] = 1
        hidden = target.model(input_ids=ids, attention_mask=mask).last_hidden_state  # right padding: valid rows exact
        for b, i in enumerate(idx):
            feats[i] = hidden[b, :len(sequences[i])].to(torch.bfloat16).clone()
        done += int(mask.sum())
        if (start // batch) % 50 == 0:
            log(f"features {start + len(idx)}/{len(order)}: {done / (time.perf_counter() - t0):.0f} tok/s")
    out = [feats[i] for i in range(len(sequences))]
    return out


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


def _batches(n_tokens: list[int], cfg: EagleConfig, gen: torch.Generator):
    order = torch.randperm(len(n_tokens), generator=gen).tolist()
    batch, size = [], 0
    for i in order:
        if batch and size + n_tokens[i] > cfg.batch_tokens:
            yield batch
            batch, size = [], 0
        batch.append(i)
        size += n_tokens[i]
    if batch:
        yield batch


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
    with torch.autocast("cpu", dtype=torch.bfloat16):
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
    gen = torch.Generator().manual_seed(cfg.seed)
    noise_gen = torch.Generator().manual_seed(cfg.seed + 1)
    std = float(torch.cat([f[:64].float() for f in feats[:256]]).std())
    n_tokens = [len(s) for s in seqs]
    params = [p for p in head.parameters() if p.requires_grad]
    total = sum(1 for _ in _batches(n_tokens, cfg, torch.Generator().manual_seed(0))) * cfg.epochs
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0, foreach=False)

    def lr_at(step):
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - cfg.warmup) / max(1, total - cfg.warmup))))

    head.train()
    step, t0, history = 0, time.perf_counter(), []
    for epoch in range(cfg.epochs):
        losses, agrees = [], []
        for batch in _batches(n_tokens, cfg, gen):
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            loss, agree = _loss(head, seqs, feats, prompt_lens, batch, cfg, std, noise_gen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            losses.append(loss.item())
            agrees.append(agree.item())
            step += 1
            if step % 25 == 0:  # losses restart each epoch: the window may be shorter than 25
                recent = min(25, len(losses))
                log(f"step {step}/{total}: loss {sum(losses[-recent:]) / recent:.4f}, top-1 agreement "
                    f"{sum(agrees[-recent:]) / recent:.3f} ({time.perf_counter() - t0:.0f} s)")
        history.append({"loss": sum(losses) / len(losses), "top1_agreement": sum(agrees) / len(agrees)})
        log(f"epoch {epoch + 1}/{cfg.epochs}: {history[-1]} ({time.perf_counter() - t0:.0f} s)")
    head.eval()
    return {"steps": step, "epochs": history, "wall_s": time.perf_counter() - t0}


def draft_vocabulary(seqs, prompt_lens, size: int, vocab: int) -> torch.Tensor | None:
    """The `size` ids most frequent in the answers (ties by id), sorted; None for all."""
    if not size or size >= vocab:
        return None
    counts = torch.zeros(vocab, dtype=torch.long)
    for seq, pl in zip(seqs, prompt_lens):
        counts += torch.bincount(seq[pl:].long(), minlength=vocab)
    order = sorted(range(vocab), key=lambda i: (-int(counts[i]), i))
    return torch.tensor(sorted(order[:size]))


def save(head: EagleTrainHead, target, out, fingerprint: str, cfg: EagleConfig,
         draft_ids: torch.Tensor | None = None) -> None:
    import json
    from dataclasses import asdict

    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = head.state_for_checkpoint()
    if draft_ids is not None:  # EAGLE-3's convention: target id = draft id + d2t[draft id]
        state["d2t"] = (draft_ids - torch.arange(len(draft_ids))).contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = target.config.to_dict()
    config.update(num_hidden_layers=1, architectures=["LlamaForCausalLM"], torch_dtype="bfloat16",
                  specd_target_fingerprint=fingerprint, specd_eagle={"recipe": "EAGLE-1", **asdict(cfg)})
    config.pop("dtype", None)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


@torch.inference_mode()
def acceptance(proposer, seqs, feats, prompt_lens, k: int) -> dict:
    """Greedy speculation replayed through the serving proposer on the target's own greedy
    answers: after the prefill (prompt + the target's first token) each step sends the newly
    committed tokens with the rows that predicted them, as the verifier does; the drafts are
    accepted while they equal the answer, then the answer's next token is committed too."""
    from specd.proposers.base import ProposeRequest

    accepted_at, offered_at = [0] * k, [0] * k
    steps = tokens = 0
    for sid, (seq, f, pl) in enumerate(zip(seqs, feats, prompt_lens)):
        ids, n = seq.tolist(), len(seq)
        done, c = 0, pl + 1
        while c < n:
            full = done == 0
            req = ProposeRequest(seq_id=sid, new_tokens=ids[done:c], num_tokens=c, k=min(k, n - c), full_history=full,
                                 features=f[0 if full else done - 1: c - 1], feature_layers=proposer.feature_layers)
            drafts = proposer.propose([req])[0].token_ids
            j = 0
            while j < len(drafts) and drafts[j] == ids[c + j]:
                j += 1
            for pos in range(min(j + 1, len(drafts))):  # offered: every earlier draft was accepted
                offered_at[pos] += 1
            for pos in range(j):
                accepted_at[pos] += 1
            steps += 1
            tokens += min(j + 1, n - c)
            done, c = c, c + j + 1
        proposer.release([sid])
    alpha = [a / o if o else 0.0 for a, o in zip(accepted_at, offered_at)]
    return {"k": k, "alpha_per_position": alpha, "tokens_per_step": tokens / max(1, steps),
            "alpha": sum(accepted_at) / max(1, sum(offered_at))}


def train_eagle(target_dir, out, args, log=print) -> dict:
    """The whole run: answers (cached, shared with the draft_model recipe) -> features -> train
    -> held-out acceptance through the serving proposer -> checkpoint + eval.json."""
    import json

    from transformers import AutoModelForCausalLM

    from specd.chat import chat_prompt_ids
    from specd.engine.loader import load_model, read_arch_config
    from specd.proposers.hidden_state import HiddenStateProposer
    from specd.tokenizer import Tokenizer
    from specd.train_drafter.command import _cached_answers, training_answers
    from specd.workloads import WORKLOADS, workload

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
        hs = _cached_answers(target_dir, msgs, args, log, greedy_only=True, dtype="float32")
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
                        "wall_s_total": time.perf_counter() - t0},
              "heldout": evals, "config": {k: v for k, v in vars(cfg).items()}}
    (out / "eval.json").write_text(json.dumps(result, indent=1) + "\n")
    from specd.train_drafter.eagle_card import finish

    finish(target_dir, out, args.threads, f"specd train-drafter --method eagle --threads {args.threads} "
           f"--prompts {args.prompts} --questions {args.questions} --out {out}")
    for name, by_k in evals.items():
        a = by_k[4]
        log(f"{name}: k=4 alpha per position {[round(x, 3) for x in a['alpha_per_position']]}, "
            f"tokens/step {a['tokens_per_step']:.2f}")
    return result
