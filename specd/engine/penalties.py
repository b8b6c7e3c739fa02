"""Penalties, logit_bias and min_tokens: part of the target distribution at every verify position.

What plain decoding applies to the logits of output position j, in vLLM's order (its sampler):
  min_tokens          EOS and stop_token_ids at -inf while j < min_tokens;
  logit_bias          logits[t] += bias[t] (OpenAI's; the gateway clamps biases to [-100, 100]);
  repetition_penalty  r over tokens in the prompt or the output so far (vLLM / transformers):
                      a positive logit divided by r, a negative one multiplied;
  frequency_penalty   f * (times t is in the output so far), subtracted (OpenAI's);
  presence_penalty    p * (t is in the output so far), subtracted (OpenAI's).
"So far" at a verify row is the committed output plus the drafts before that row (a chain's earlier
drafts; a tree node's path), so the row is exactly what plain decoding would see there had those
drafts been its tokens. Greedy takes the argmax of these logits; rejection sampling judges drafts
against the distribution they make. The logits are changed before the sampler reads them, so every
path (the fused CPU walk, the general path, the seeded position walk, trees, a GPU) sees the same rows.

Batched: one [rows, V] count tensor for the step's penalised rows, built from each sequence's
committed counts and its drafts' one-hot increments; the arithmetic is a few tensor ops over those rows
on the logits' device. The host loops only to gather the ids (as for drafts elsewhere).
"""
from __future__ import annotations

import torch

from specd.kernels.tree_rejection_sampler import chain_parents, path_to
from specd.sampling import SamplingParams


def penalised(p: SamplingParams) -> bool:
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 or p.logit_bias
                or p.min_tokens)


def apply_penalties(batch, logits: torch.Tensor, eos_token_ids) -> torch.Tensor:
    """The step's logits [R, V] (rows in batch order: each sampled entry's drafts, then its last row)
    with every row of a sequence whose params penalise changed: a new tensor, so the raw logits stay
    what logprobs report (vLLM's default, raw logprobs); `logits` itself where no sequence penalises."""
    rows, row_seq, row_params = [], [], []  # per penalised row: its logits row, its sequence, its params
    base_pairs, prompt_pairs, step_pairs = ([], []), ([], []), ([], [])  # (row or sequence, token) lists
    bias, blocked = ([], [], []), ([], [])  # (row, token, value), (row, token)
    r = S = 0  # S: penalised sequences so far
    for e in batch:
        if not e.num_logits:
            continue
        n, p = len(e.draft_token_ids), e.seq.params
        if penalised(p):
            s, S = S, S + 1
            counting = p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty
            if counting:
                _extend(base_pairs, s, e.seq.output_token_ids)
                if p.repetition_penalty != 1.0:
                    _extend(prompt_pairs, s, e.seq.prompt_token_ids)
            parents = (e.drafts.parents if e.drafts is not None else None) or chain_parents(n)
            first = r + e.num_logits - 1 - n  # the row after the last committed token, then one per draft
            stops = sorted({*eos_token_ids, *p.stop_token_ids})
            for i in range(n + 1):  # row i sees the drafts on the path to node i - 1
                j = len(rows)
                rows.append(first + i)
                row_seq.append(s)
                row_params.append(p)
                path = [e.draft_token_ids[d] for d in path_to(i - 1, parents)]
                if counting:
                    _extend(step_pairs, j, path)
                if len(e.seq.output_token_ids) + len(path) < p.min_tokens:
                    _extend(blocked, j, stops)
                for t, v in p.logit_bias.items():
                    bias[0].append(j), bias[1].append(t), bias[2].append(v)
        r += e.num_logits
    if not rows:
        return logits
    V, dev = logits.shape[-1], logits.device
    index = torch.tensor(rows, device=dev)
    x = logits.index_select(0, index)  # [P, V]

    def ids(pairs):
        return tuple(torch.tensor(a, dtype=torch.long, device=dev) for a in pairs)

    if blocked[0]:
        x.index_put_(ids(blocked), torch.tensor(float("-inf"), device=dev))
    if bias[0]:
        x.index_put_(ids(bias[:2]), torch.tensor(bias[2], dtype=x.dtype, device=dev), accumulate=True)
    if any(p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty for p in row_params):
        which = torch.tensor(row_seq, device=dev)
        counts = torch.zeros(S, V, dtype=x.dtype, device=dev)
        counts.index_put_(ids(base_pairs), torch.ones(len(base_pairs[0]), device=dev), accumulate=True)
        counts = counts.index_select(0, which)  # [P, V]: the committed output's counts, then the path's drafts
        counts.index_put_(ids(step_pairs), torch.ones(len(step_pairs[0]), device=dev), accumulate=True)
        in_prompt = torch.zeros(S, V, dtype=torch.bool, device=dev)
        in_prompt.index_put_(ids(prompt_pairs), torch.tensor(True, device=dev))
        rep = torch.tensor([p.repetition_penalty for p in row_params], dtype=x.dtype, device=dev)[:, None]
        seen = (counts > 0) | in_prompt.index_select(0, which)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        freq = torch.tensor([p.frequency_penalty for p in row_params], dtype=x.dtype, device=dev)[:, None]
        pres = torch.tensor([p.presence_penalty for p in row_params], dtype=x.dtype, device=dev)[:, None]
        x = x - freq * counts - pres * (counts > 0).to(x.dtype)
    with torch.inference_mode():  # the forward's logits are inference tensors
        return logits.index_copy(0, index, x)


def _extend(pairs: tuple[list, ...], key: int, tokens) -> None:
    pairs[0].extend([key] * len(tokens))
    pairs[1].extend(tokens)

