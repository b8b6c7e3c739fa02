"""Held-out evaluation of the demo pair: loss per token, and greedy acceptance of the
drafter against the target per draft position for k = 1..8.

Greedy speculative decoding needs no step-by-step simulation with two KV caches: with a
greedy target the output is the target's greedy continuation T whatever k is, and an
accepted draft token equals T's token, so while drafts are being accepted the drafter's
context is exactly a prefix of T. Draft i of a step starting at position j is therefore
accepted (given drafts < i were) iff argmax drafter(T[:j+i-1]) == T[j+i-1]. One
teacher-forced drafter pass over T gives that match bit for every position; the
k-dependent bookkeeping is then exact integer arithmetic (see `simulate`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache

MAX_K = 8


def token_stream(tok, texts: list[str]) -> torch.Tensor:
    """Concatenate texts as <|bos|> text <|eos|> ... into one [N] int64 tensor."""
    bos, eos = tok.token_to_id("<|bos|>"), tok.token_to_id("<|eos|>")
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.append(bos)
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def loss_windows(stream: torch.Tensor, context: int, max_windows: int | None = None) -> torch.Tensor:
    """Non-overlapping [W, context+1] windows from the start of the stream."""
    span = context + 1
    n = stream.numel() // span
    if max_windows is not None:
        n = min(n, max_windows)
    return stream[: n * span].view(n, span)


@torch.no_grad()
def heldout_loss(model, windows: torch.Tensor, batch: int = 16) -> float:
    """Mean cross entropy (nats per token) of next-token prediction over the windows."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i : i + batch].to(device)  # [b, T+1]
        logits = model(input_ids=w[:, :-1]).logits.float()  # [b, T, V]
        total += F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
        count += w[:, 1:].numel()
    return total / count


def prompts_from(stream: torch.Tensor, n: int, length: int) -> torch.Tensor:
    """n prompts of `length` tokens at evenly spaced offsets of the held-out stream."""
    last = stream.numel() - length - 1
    if n < 1 or last < 0:
        raise ValueError(f"cannot cut {n} prompts of {length} tokens from {stream.numel()} tokens")
    starts = torch.linspace(0, last, n).long()
    return torch.stack([stream[s : s + length] for s in starts.tolist()])  # [n, length]


@torch.no_grad()
def greedy_continue(model, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """The model's greedy continuation with a KV cache: [n, P] -> [n, P + new_tokens]."""
    device = next(model.parameters()).device
    ids = prompts.to(device)
    cache = DynamicCache()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    seq = [ids]
    for i in range(new_tokens):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)  # [n, 1]
        seq.append(nxt)
        if i + 1 < new_tokens:
            out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
    return torch.cat(seq, dim=1).cpu()


@torch.no_grad()
def draft_matches(drafter, seqs: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """[n, G] bool: drafter's greedy next token on T[:P+j] equals T[P+j]."""
    device = next(drafter.parameters()).device
    logits = drafter(input_ids=seqs[:, :-1].to(device)).logits  # [n, P+G-1, V]
    pred = logits.argmax(-1).cpu()[:, prompt_len - 1 :]  # predictions for T[P:]
    return pred == seqs[:, prompt_len:]


@dataclass
class Acceptance:
    k: int
    attempted: list[int]  # [k] steps that reached draft position i (drafts < i accepted)
    accepted: list[int]   # [k] of those, steps whose draft i was accepted
    steps: int            # target verification passes
    drafted: int          # k * steps

    @property
    def per_position(self) -> list[float]:
        return [a / t if t else 0.0 for a, t in zip(self.accepted, self.attempted)]

    @property
    def alpha(self) -> float:
        """Per-token acceptance: accepted drafts / drafted tokens."""
        return sum(self.accepted) / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens emitted per target pass (accepted + the bonus/replacement)."""
        return 1.0 + sum(self.accepted) / self.steps if self.steps else 0.0


def simulate(matches: torch.Tensor, k: int, gen_len: int) -> Acceptance:
    """Greedy speculative decoding bookkeeping for k drafts per step over gen_len tokens.

    matches: [n, >= gen_len - 1 + k] bool from `draft_matches`.
    """
    if matches.shape[1] < gen_len - 1 + k:
        raise ValueError(f"need {gen_len - 1 + k} match columns for k={k}, got {matches.shape[1]}")
    acc = Acceptance(k=k, attempted=[0] * k, accepted=[0] * k, steps=0, drafted=0)
    for row in matches.tolist():
        pos = 0
        while pos < gen_len:
            run = 0
            while run < k and row[pos + run]:
                run += 1
            for i in range(min(run + 1, k)):
                acc.attempted[i] += 1
            for i in range(run):
                acc.accepted[i] += 1
            acc.steps += 1
            acc.drafted += k
            pos += run + 1  # accepted drafts plus the target's own token
    return acc


def acceptance_table(target, drafter, prompts: torch.Tensor, gen_len: int,
                     ks=range(1, MAX_K + 1)) -> dict[int, Acceptance]:
    ks = list(ks)
    seqs = greedy_continue(target, prompts, gen_len + max(ks))
    matches = draft_matches(drafter, seqs, prompts.shape[1])
    return {k: simulate(matches, k, gen_len) for k in ks}


def sample_continuation(model, tok, text: str, new_tokens: int) -> str:
    ids = torch.tensor([tok.encode(text).ids])  # post-processor adds <|bos|>
    new = greedy_continue(model, ids, new_tokens)[0, ids.shape[1] :].tolist()
    eos = tok.token_to_id("<|eos|>")
    if eos in new:  # a sample ends where the model ends the file
        new = new[: new.index(eos)]
    return text + tok.decode(new)
