"""Rejection sampling over token trees (SpecInfer's multi-step speculative sampling): the reference.

Sequence b of a step drafted a tree of n_b nodes: node i is draft_token_ids[cu[b] + i], its
parent parents[b][i] (-1: the root, the last committed token; parents point backwards). Its
target rows are rows[b] .. rows[b] + n_b of the step's logits: row 0 the root's, row 1 + i
node i's (the target's distribution after the path to node i). The walk starts at the root:
  greedy   take the first child equal to the argmax of the current row; stop when none is;
           the last token is the argmax of the row where the walk stopped.
  random   try the children in order: accept child x (drawn from q_x: one-hot, or its sparse
           q) with probability min(1, p(x)/q_x(x)); on rejection p <- norm(max(p - q_x, 0)) and
           try the next sibling. After an accept, continue from that child with its own row.
           When every child was rejected (or there are none), the last token is drawn from the
           final residual, or from the row itself when no child was tried (the bonus).
Lossless for any q: each sibling test is a speculative sampling step against the residual
left by the siblings before it, so the emitted token follows p whatever q each sibling was
drawn from, provided it was drawn independently of the acceptance uniforms (SpecInfer,
Miao et al. 2024, Theorem 4.2; siblings drawn without replacement send the conditional q).
The last token is drawn with the sequence's drawing randomness (draw_from: its noise row or
its uniform), as a chain's recovered or bonus token is, so a chain given as parents [-1, 0, 1, ...] takes exactly the
decisions of the chain sampler (tests/engine/test_token_trees.py checks that).
This walks the tree per sequence on the host side: the number of nodes is small, and a
sampled sibling needs the residual its elder siblings left.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specd.kernels.rejection_sampler_ref import draw_from

if TYPE_CHECKING:
    from specd.kernels.rejection_sampler import SpecDecodeMetadata


def chain_parents(n: int) -> list[int]:
    return list(range(-1, n - 1))


def path_to(node: int, parents: list[int]) -> list[int]:
    """Node indices from the root's first child to `node` (inclusive); [] for -1 (the root itself)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def tree_rejection_sample_ref(
    meta: SpecDecodeMetadata,
    target_probs: torch.Tensor | None,  # [R, V] float32, filtered; R = Σ (n_b + 1); None: all greedy
    target_argmax: torch.Tensor,  # [R] int64, argmax of the raw logits
    uniforms: torch.Tensor | None,  # [N] float32, one per node; None: all greedy
    noise: torch.Tensor | None,  # [B, V] float32 Exp(1) > 0, or [B] uniforms (draw_from); None: all greedy
) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """-> per sequence: emitted tokens (accepted path, then one), accepted count, accepted nodes."""
    tokens = meta.draft_token_ids.tolist()
    argmax = target_argmax.tolist()
    greedy = meta.is_greedy.tolist()
    out, n_acc, paths = [], [], []
    node0 = row0 = 0
    for b, n in enumerate(meta.num_draft_host):
        parents = (meta.parents[b] if meta.parents is not None else None) or chain_parents(n)
        children: list[list[int]] = [[] for _ in range(n + 1)]  # by row: 0 root, 1 + i node i
        for i, p in enumerate(parents):
            children[p + 1].append(i)
        path, cur = [], 0
        while True:
            if greedy[b]:
                nxt = next((i for i in children[cur] if tokens[node0 + i] == argmax[row0 + cur]), None)
                if nxt is None:
                    last = argmax[row0 + cur]
                    break
            else:
                p, nxt = target_probs[row0 + cur], None
                for i in children[cur]:
                    x = tokens[node0 + i]
                    q = _dense_q(meta, node0 + i, x, p)
                    if bool(uniforms[node0 + i] * q[x] < p[x]):  # u < min(1, p/q) without a division
                        nxt = i
                        break
                    p = _residual(p, q)
                if nxt is None:
                    last = int(draw_from(p[None], noise[b][None])[0])
                    break
            path.append(nxt)
            cur = nxt + 1
        out.append([tokens[node0 + i] for i in path] + [last])
        n_acc.append(len(path))
        paths.append(path)
        node0 += n
        row0 += n + 1
    return out, n_acc, paths


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:  # [V], [V] -> norm(max(p - q, 0))
    w = torch.clamp_min(p - q, 0.0)
    s = w.sum()
    # Rounding can leave no residual mass where p == q on the support: keep p.
    return w / s if bool(s > 0) else p


def _dense_q(meta: SpecDecodeMetadata, node: int, x: int, like: torch.Tensor) -> torch.Tensor:  # [V]
    q = torch.zeros_like(like)
    if meta.draft_q_ids is None:
        q[x] = 1.0
    else:
        ids = meta.draft_q_ids[node]
        q.scatter_add_(0, ids.clamp_min(0), meta.draft_q_probs[node] * (ids >= 0))
    return q
