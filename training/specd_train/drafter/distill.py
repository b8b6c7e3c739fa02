"""Distil a few-layer drafter from the target, on the target's own chat answers.

The drafter is the target's architecture cut to a few layers, initialised from target layers,
sharing the target's token embeddings and (tied) output head, which stay frozen: only its
layers and final norm train, and only those are committed. The teacher signal is the
target's distribution at every position, kept as its top `topk` log-probabilities
(precomputed once, so epochs do not rerun the target), and the loss is
    cross-entropy(teacher top-k, renormalised)  +  argmax_weight * CE(teacher argmax),
weighted 1 on answer tokens (what the drafter is verified on) and `prompt_weight` on
prompt tokens (stdlib code and docs: the corpus part).
Every random draw is seeded and the thread count fixed, so a rerun is bit-identical.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specd_train.drafter import precision


@dataclass(frozen=True)
class DistillConfig:
    layers: tuple[int, ...] = (0, 1)  # target layers the drafter's layers start from
    topk: int = 64
    max_len: int = 512
    epochs: int = 2
    batch_tokens: int = 4096
    lr: float = 3e-3
    warmup: int = 20
    argmax_weight: float = 0.5
    prompt_weight: float = 0.25
    draft_vocab: int = 8192  # the drafter's output head covers the target's most frequent tokens
    seed: int = 0


@dataclass
class Example:
    ids: torch.Tensor        # [L] int64: prompt + answer
    prompt_len: int
    top_ids: torch.Tensor    # [L-1, topk] int32: teacher's top-k next-token ids at each position
    top_logp: torch.Tensor   # [L-1, topk] float16: their log-probabilities


def make_drafter(target, layers: tuple[int, ...]):
    """A transformers Llama with `layers` copied from the target; embeddings tied and frozen."""
    from transformers import AutoModelForCausalLM

    cfg = target.config.__class__.from_dict(target.config.to_dict())
    cfg.num_hidden_layers = len(layers)
    cfg.tie_word_embeddings = True
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [cfg.layer_types[i] for i in layers]
    drafter = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    drafter.model.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight.data)
    for mine, theirs in zip(drafter.model.layers, layers):
        mine.load_state_dict({k: v.float() for k, v in target.model.layers[theirs].state_dict().items()})
    drafter.model.norm.load_state_dict({k: v.float() for k, v in target.model.norm.state_dict().items()})
    drafter.model.embed_tokens.weight.requires_grad_(False)
    return drafter


@torch.inference_mode()
def teacher_topk(target, sequences: list[torch.Tensor], prompt_lens: list[int], cfg: DistillConfig,
                 log=print) -> list[Example]:
    out, t0, done = [], time.perf_counter(), 0
    for i, (ids, plen) in enumerate(zip(sequences, prompt_lens)):
        ids = ids[: cfg.max_len]
        logp = F.log_softmax(target(input_ids=ids[None, :-1]).logits[0].float(), dim=-1)  # [L-1, V]
        top = logp.topk(cfg.topk, dim=-1)
        out.append(Example(ids, min(plen, len(ids)), top.indices.to(torch.int32), top.values.to(torch.float16)))
        done += len(ids)
        if (i + 1) % 200 == 0:
            log(f"teacher {i + 1}/{len(sequences)}: {done / (time.perf_counter() - t0):.0f} tok/s")
    return out


def _batches(examples: list[Example], cfg: DistillConfig, gen: torch.Generator):
    """Shuffled batches of about batch_tokens tokens, each sequence right-padded."""
    order = torch.randperm(len(examples), generator=gen).tolist()
    batch, tokens = [], 0
    for i in order:
        batch.append(examples[i])
        tokens += len(examples[i].ids)
        if tokens >= cfg.batch_tokens:
            yield batch
            batch, tokens = [], 0
    if batch:
        yield batch


def choose_draft_vocab(examples: list[Example], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` ids the target most often puts first, counted over all training positions
    (ties broken by id): the drafter's output head covers only these, which cuts its largest
    cost (a 49152 x 576 head is most of a small drafter's per-token work) for a small loss in
    coverage, reported on the card."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for e in examples:
        counts += torch.bincount(e.top_ids[:, 0].long(), minlength=vocab_size)
    order = sorted(range(vocab_size), key=lambda i: (-int(counts[i]), i))
    return torch.tensor(sorted(order[:size]), dtype=torch.long)


class SubsetHead(torch.nn.Module):
    """Logits over the draft vocabulary from the frozen embedding rows (tied head)."""

    def __init__(self, drafter, ids: torch.Tensor):
        super().__init__()
        self.drafter, self.ids = drafter, ids
        self.to_draft = torch.full((drafter.config.vocab_size,), -1, dtype=torch.long)
        self.to_draft[ids] = torch.arange(len(ids))

    def hidden(self, input_ids, attention_mask=None):
        return self.drafter.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    def logits(self, h):  # [N, H] -> [N, len(ids)]
        return h @ self.drafter.model.embed_tokens.weight[self.ids].T

    def argmax(self, h):  # full-vocabulary ids
        return self.ids[self.logits(h).argmax(-1)]


def _loss(head: SubsetHead, batch: list[Example], cfg: DistillConfig) -> torch.Tensor:
    L = max(len(e.ids) for e in batch) - 1
    B = len(batch)
    inputs = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    weight = torch.zeros(B, L)
    for b, e in enumerate(batch):
        n = len(e.ids) - 1
        inputs[b, :n] = e.ids[:-1]
        mask[b, :n] = 1
        weight[b, :n] = cfg.prompt_weight
        weight[b, e.prompt_len - 1: n] = 1.0  # positions that predict answer tokens
    valid = mask.bool()
    top_ids = torch.cat([e.top_ids.long() for e in batch])  # [N, K] in the order of valid positions
    top_logp = torch.cat([e.top_logp.float() for e in batch])
    with precision.autocast():
        h = head.hidden(inputs, mask)[valid]  # [N, H]: padding never reaches the head
        logq = F.log_softmax(head.logits(h).float(), dim=-1)  # [N, V_d]
    draft_ids = head.to_draft[top_ids]  # [N, K]; -1 where the draft vocab lacks the token
    p = F.softmax(top_logp.masked_fill(draft_ids < 0, -1e4), dim=-1)  # teacher, renormalised on the draft vocab
    ce = -(p * logq.gather(-1, draft_ids.clamp(min=0))).sum(-1)
    top1 = draft_ids[:, 0]
    ce = ce + cfg.argmax_weight * -(logq.gather(-1, top1.clamp(min=0)[:, None]).squeeze(-1)) * (top1 >= 0)
    w = weight[valid]
    return (ce * w).sum() / w.sum()


def train(head: SubsetHead, examples: list, cfg, log=print, batches=None, loss=None) -> dict:
    """AdamW (decay on matrices only), warmup then cosine to 10%, gradients clipped at 1, over
    cfg.epochs of batches(examples, cfg, generator) with loss(head, batch) (default: this module's
    distillation; parallel.py passes its own rows and loss). A batch is a list of items with .ids."""
    batches = batches or _batches
    loss = loss or (lambda h, batch: _loss(h, batch, cfg))
    drafter = head.drafter
    gen = torch.Generator().manual_seed(cfg.seed)
    params = [p for p in drafter.parameters() if p.requires_grad]
    steps_per_epoch = sum(1 for _ in batches(examples, cfg, torch.Generator().manual_seed(0)))
    total = steps_per_epoch * cfg.epochs
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.01},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), foreach=False)

    def lr_at(step):
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - cfg.warmup) / max(1, total - cfg.warmup))))

    drafter.train()
    step, t0, history, seen = 0, time.perf_counter(), [], 0
    for epoch in range(cfg.epochs):
        losses = []
        for batch in batches(examples, cfg, gen):
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            value = loss(head, batch)
            opt.zero_grad(set_to_none=True)
            value.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            losses.append(value.item())
            seen += sum(len(x.ids) for x in batch)
            step += 1
            if step % 50 == 0:
                log(f"step {step}/{total}: loss {sum(losses[-50:]) / len(losses[-50:]):.4f}, "
                    f"{seen / (time.perf_counter() - t0):.0f} rows/s ({time.perf_counter() - t0:.0f} s)")
        history.append(sum(losses) / len(losses))
        log(f"epoch {epoch + 1}/{cfg.epochs}: loss {history[-1]:.4f} ({time.perf_counter() - t0:.0f} s)")
    drafter.eval()
    return {"steps": step, "rows": seen, "epoch_losses": history, "wall_s": time.perf_counter() - t0}


@torch.inference_mode()
def acceptance(head: SubsetHead, examples: list[Example], k: int) -> dict:
    """Greedy speculation replayed on the target's own greedy answers (no target call needed):
    a draft chain from the true prefix is the drafter's teacher-forced argmax run, because every
    accepted draft equals the true next token. Steps start where the previous one ended."""
    accepted_at = [0] * k  # drafts accepted at position j
    offered_at = [0] * k   # drafts offered at position j (the earlier ones were accepted)
    steps = tokens = 0
    for e in examples:
        n = len(e.ids) - 1
        guess = head.argmax(head.hidden(e.ids[None, :-1])[0])  # [n]: draft for token i+1
        hit = (guess == e.ids[1:]).tolist()
        i = e.prompt_len - 1
        while i < n:
            j = 0
            while j < k and i + j < n:
                offered_at[j] += 1
                if not hit[i + j]:
                    break
                accepted_at[j] += 1
                j += 1
            steps += 1
            tokens += j + 1  # accepted drafts + the target's own token
            i += j + 1
    alpha = [a / o if o else 0.0 for a, o in zip(accepted_at, offered_at)]
    return {"k": k, "alpha_per_position": alpha, "tokens_per_step": tokens / max(1, steps),
            "alpha": sum(accepted_at) / max(1, sum(offered_at))}
