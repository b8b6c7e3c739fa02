"""Parallel drafting (PARD, Chen et al. 2025): teach the draft model to draft k tokens in one forward.

At serving time the drafter reads the committed tokens followed by k - 1 copies of a mask token
(`pard_token`); the last real row drafts token 1 and the j-th mask's row token j + 1, each from
the committed context alone (specd/proposers/draft_model.py). On a CPU, where a 1-4 row forward
costs about what one row costs, that turns a k-token draft from k small forwards into one.

Training adapts the AR drafter (its weights are the start) on the target's own conversations
(`specd drafter-data` shards). Each sequence becomes one row per real token (the AR objective,
kept so draft 1 stays as it was) plus, for anchors i in the answer, mask rows at positions
i + 1 .. i + k - 1 that predict tokens i + 2 .. i + k. A mask row sees the real tokens up to i and
the masks of its own anchor before it, exactly the causal view it has when serving; one 4D
attention mask holds all of it. PARD's conditional drop-token keeps mask group j at a share
keep[j] of the anchors (nested: a kept group's earlier groups are kept), which cuts the rows
~2x for little loss. Loss: cross-entropy to the data's next token over the draft vocabulary
(the target's greedy token for 2 answers in 3, a T = 0.7 sample for the third), weight 1 on
answer tokens and prompt_weight on prompt tokens. Seeded throughout: a rerun with the same
threads and libraries gives the same weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specd_train.drafter import distill, precision

FAR = 1 << 30  # the anchor of padding: no real row attends to it


@dataclass(frozen=True)
class ParallelConfig:
    drafts: int = 4                               # k: tokens one forward drafts
    keep: tuple[float, ...] = (1.0, 0.6, 0.45, 0.35)  # share of answer anchors with mask group j
    pard_token: int = 16                          # SmolLM2's <empty_output>: never in chat text
    max_len: int = 512
    epochs: int = 1
    batch_rows: int = 6144
    lr: float = 1e-3
    warmup: int = 20
    prompt_weight: float = 0.25
    seed: int = 0


@dataclass
class Rows:
    """One sequence laid out for a parallel-drafting forward."""
    ids: torch.Tensor        # [T] input token per row (real tokens, then masks)
    positions: torch.Tensor  # [T]
    anchor: torch.Tensor     # [T] the last real token a row may see
    group: torch.Tensor      # [T] 0: real row; j: the j-th mask after its anchor
    labels: torch.Tensor     # [T] the token the row drafts (-1: none)
    weight: torch.Tensor     # [T]


def layout(ids: torch.Tensor, prompt_len: int, cfg: ParallelConfig, keep_draw: torch.Tensor | None) -> Rows:
    """Rows of one sequence. keep_draw: a uniform draw per token (None: keep every mask group)."""
    n = len(ids) - 1  # real rows 0..n-1 predict ids[1..n]
    real = torch.arange(n)
    parts = [(ids[:n], real, real, torch.zeros(n, dtype=torch.long), ids[1:],
              torch.where(real + 1 >= prompt_len, 1.0, cfg.prompt_weight))]
    anchors = torch.arange(min(max(prompt_len - 1, 0), n), n)
    for j in range(1, cfg.drafts):
        a = anchors[anchors + j + 1 <= n]  # the label ids[a + j + 1] exists
        if keep_draw is not None:
            a = a[keep_draw[a] < cfg.keep[j]]
        parts.append((torch.full_like(a, cfg.pard_token), a + j, a, torch.full_like(a, j), ids[a + j + 1],
                      torch.ones(len(a))))
    return Rows(*(torch.cat(x) for x in zip(*parts)))


def attention_mask(rows: list[Rows]) -> tuple[torch.Tensor, ...]:
    """Padded batch: (ids, positions, 4D bool mask [B, 1, T, T], labels, weight)."""
    T = max(len(r.ids) for r in rows)

    def pad(x, value):
        return torch.stack([F.pad(getattr(r, x), (0, T - len(r.ids)), value=value) for r in rows])

    anchor, group = pad("anchor", FAR), pad("group", 0)
    a_q, a_k, g_q, g_k = anchor[:, :, None], anchor[:, None, :], group[:, :, None], group[:, None, :]
    # real keys up to the row's anchor; masks of the same anchor up to the row's own group
    mask = ((g_k == 0) & (a_k <= a_q)) | ((g_q > 0) & (g_k > 0) & (a_k == a_q) & (g_k <= g_q))
    return pad("ids", 0), pad("positions", 0), mask[:, None], pad("labels", -1), pad("weight", 0.0)


def _batches(data: list, cfg: ParallelConfig, gen: torch.Generator):
    order = torch.randperm(len(data), generator=gen).tolist()
    batch, size = [], 0
    for i in order:
        ids, plen = data[i]
        ids = ids[: cfg.max_len]
        rows = layout(ids, min(plen, len(ids)), cfg, torch.rand(len(ids), generator=gen))
        batch.append(rows)
        size += len(rows.ids)
        if size >= cfg.batch_rows:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _hidden(head, ids, positions, mask):
    return head.drafter.model(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state


def _loss(head, batch: list[Rows]) -> torch.Tensor:
    ids, positions, mask, labels, weight = attention_mask(batch)
    target = head.to_draft[labels.clamp(min=0)]
    valid = (labels >= 0) & (target >= 0)  # tokens outside the draft vocabulary: no signal
    with precision.autocast():
        logq = F.log_softmax(head.logits(_hidden(head, ids, positions, mask)[valid]).float(), dim=-1)
    ce = -logq.gather(-1, target[valid][:, None]).squeeze(-1)
    return (ce * weight[valid]).sum() / weight[valid].sum()


def train(head, data: list, cfg: ParallelConfig, log=print) -> dict:
    """distill.train's loop (AdamW, warmup, cosine) over this module's rows and loss."""
    return distill.train(head, data, cfg, log, batches=_batches, loss=_loss)


@torch.inference_mode()
def acceptance(head, examples: list, cfg: ParallelConfig) -> dict:
    """Greedy speculation replayed on the target's own greedy answers, k = cfg.drafts, two ways from
    one forward per sequence: parallel (draft j from the anchor's mask row j - 1, as served) and
    sequential (the AR chain: since every accepted draft is the true token, draft j is the real
    row at anchor + j - 1). alpha_j: draft j accepted given drafts 1..j-1 were."""
    k = cfg.drafts
    stats = {m: {"accepted": [0] * k, "offered": [0] * k, "steps": 0, "tokens": 0} for m in ("parallel", "sequential")}
    for ids, plen in examples:
        ids = ids[: cfg.max_len]
        rows = layout(ids, plen, cfg, None)
        tokens, positions, mask, _, _ = attention_mask([rows])
        guess = head.argmax(_hidden(head, tokens, positions, mask)[0])
        n = len(ids) - 1
        at = {(int(a), int(g)): int(t) for a, g, t in zip(rows.anchor, rows.group, guess)}
        for mode, s in stats.items():
            i = plen - 1
            while i < n:
                j = 0
                while j < k and i + j < n:
                    d = at[(i, j)] if mode == "parallel" else at[(i + j, 0)]
                    s["offered"][j] += 1
                    if d != int(ids[i + j + 1]):
                        break
                    s["accepted"][j] += 1
                    j += 1
                s["steps"] += 1
                s["tokens"] += j + 1
                i += j + 1
    return {mode: {"alpha_per_position": [a / o if o else 0.0 for a, o in zip(s["accepted"], s["offered"])],
                   "alpha": sum(s["accepted"]) / max(1, sum(s["offered"])),
                   "tokens_per_step": s["tokens"] / max(1, s["steps"])} for mode, s in stats.items()}
