"""Training loops for the demo pair: the target on next-token loss, then the drafter
distilled from the frozen target's logits (agreement with the target is what speculative
decoding rewards, so the drafter imitates the target rather than the data).

Everything is budgeted in steps, never wall time, and every random draw comes from a
seeded generator, so a rerun on the same machine and thread count is bit-identical.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specd_train.demo.evaluate import greedy_continue


@dataclass(frozen=True)
class Schedule:
    steps: int
    batch: int        # sequences per step
    context: int      # tokens per sequence
    lr: float
    warmup: int
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        frac = (step - self.warmup) / max(1, self.steps - self.warmup)
        cos = 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac)))
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cos)


def set_determinism(seed: int, threads: int) -> None:
    # cuBLAS is only deterministic with a fixed workspace; must be set before its first use.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.manual_seed(seed)
    torch.set_num_threads(threads)  # float reductions depend on the thread split
    torch.use_deterministic_algorithms(True, warn_only=True)


def batches(stream: torch.Tensor, sched: Schedule, seed: int, device: str):
    """Yield [batch, context+1] windows at offsets drawn from a seeded generator."""
    # stream: [N] int64, the training files concatenated (each <|bos|> ... <|eos|>)
    span = sched.context + 1
    if stream.numel() <= span:
        raise ValueError(f"training stream of {stream.numel()} tokens is shorter than one window ({span})")
    gen = torch.Generator().manual_seed(seed)
    for _ in range(sched.steps):
        starts = torch.randint(0, stream.numel() - span, (sched.batch,), generator=gen)
        idx = starts[:, None] + torch.arange(span)[None, :]
        yield stream[idx].to(device)


def greedy_pool(target, stream: torch.Tensor, sched: Schedule, rows: int, prompt_len: int, seed: int,
                device: str, chunk: int = 64) -> torch.Tensor:
    """[rows, context+1] windows: a training prefix of prompt_len tokens, then the target's
    own greedy continuation. Acceptance is measured on text the target generates, which a
    small model writes differently from the corpus (repeats, its own idioms), so the drafter
    also learns from that text (on-policy distillation, as in DistillSpec)."""
    if not 0 < prompt_len <= sched.context:
        raise ValueError(f"greedy prompt of {prompt_len} tokens does not fit a {sched.context}-token window")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, stream.numel() - prompt_len, (rows,), generator=gen)
    prompts = stream[starts[:, None] + torch.arange(prompt_len)[None, :]]
    out = []
    for i in tqdm(range(0, rows, chunk), desc="greedy pool", mininterval=5.0, dynamic_ncols=True):
        out.append(greedy_continue(target, prompts[i : i + chunk], sched.context + 1 - prompt_len))
    return torch.cat(out)


def mixed_batches(stream: torch.Tensor, pool: torch.Tensor | None, share: float, sched: Schedule, seed: int,
                  device: str):
    """Corpus windows with the last round(share * batch) rows replaced by pool windows."""
    take = round(share * sched.batch) if pool is not None else 0
    gen = torch.Generator().manual_seed(seed + 7)
    for batch in batches(stream, sched, seed, device):
        if take:
            rows = torch.randint(0, pool.shape[0], (take,), generator=gen)
            batch = torch.cat([batch[: sched.batch - take], pool[rows].to(device)])
        yield batch


def _optimizer(model: torch.nn.Module, sched: Schedule) -> torch.optim.Optimizer:
    # No weight decay on norms (1-D); foreach=False keeps the update order fixed.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": sched.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=sched.lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)


def _run(model, sched: Schedule, data, loss_fn, desc: str) -> dict:
    """Shared loop: lr schedule, clipping, progress bar with loss and tokens/s."""
    opt = _optimizer(model, sched)
    model.train()
    t0 = time.perf_counter()
    ema = None
    bar = tqdm(total=sched.steps, desc=desc, mininterval=5.0, dynamic_ncols=True)
    for step, batch in enumerate(data):
        for g in opt.param_groups:
            g["lr"] = sched.lr_at(step)
        loss = loss_fn(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), sched.clip)
        opt.step()
        value = loss.item()
        ema = value if ema is None else 0.98 * ema + 0.02 * value
        tok_s = (step + 1) * sched.batch * sched.context / (time.perf_counter() - t0)
        bar.set_postfix(loss=f"{ema:.3f}", tok_s=f"{tok_s:,.0f}", refresh=False)
        bar.update(1)
    bar.close()
    wall = time.perf_counter() - t0
    model.eval()
    return {"steps": sched.steps, "batch": sched.batch, "context": sched.context, "lr": sched.lr,
            "warmup": sched.warmup, "final_loss_ema": ema, "wall_s": wall,
            "tokens": sched.steps * sched.batch * sched.context,
            "tokens_per_s": sched.steps * sched.batch * sched.context / wall}


def train_target(model, stream: torch.Tensor, sched: Schedule, seed: int, device: str) -> dict:
    def loss_fn(batch):  # batch: [B, T+1]
        logits = model(input_ids=batch[:, :-1]).logits  # [B, T, V]
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    return _run(model, sched, batches(stream, sched, seed, device), loss_fn, "target")


def distill_drafter(drafter, target, stream: torch.Tensor, sched: Schedule, seed: int,
                    device: str, ce_weight: float = 0.0, argmax_weight: float = 0.0,
                    pool: torch.Tensor | None = None, pool_share: float = 0.0) -> dict:
    """Minimise KL(target || drafter) at temperature 1 on training windows.

    argmax_weight adds cross-entropy on the target's greedy choice: KL spends the small
    drafter's capacity on the whole distribution, while greedy acceptance only asks that
    the two argmaxes agree. pool, pool_share: see `greedy_pool`.

    The target should already hold its shipped (bf16-rounded) weights, so the drafter
    learns to agree with exactly the model it will be verified against.
    """
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)

    def loss_fn(batch):  # batch: [B, T+1]
        inputs = batch[:, :-1]
        with torch.no_grad():
            t_logp = F.log_softmax(target(input_ids=inputs).logits.float(), dim=-1)  # [B, T, V]
        d_logits = drafter(input_ids=inputs).logits  # [B, T, V]
        d_logp = F.log_softmax(d_logits, dim=-1)
        kl = F.kl_div(d_logp.flatten(0, 1), t_logp.flatten(0, 1), log_target=True,
                      reduction="batchmean")
        if argmax_weight:
            kl = kl + argmax_weight * F.cross_entropy(d_logits.flatten(0, 1), t_logp.argmax(-1).flatten())
        if ce_weight:
            kl = kl + ce_weight * F.cross_entropy(d_logits.flatten(0, 1), batch[:, 1:].flatten())
        return kl

    data = mixed_batches(stream, pool, pool_share, sched, seed + 1, device)
    return _run(drafter, sched, data, loss_fn, "drafter")
