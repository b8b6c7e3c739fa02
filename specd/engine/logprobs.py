"""Logprobs of emitted tokens, and their most likely alternatives, for the requests that ask.

What is reported is what vLLM reports by default ("raw" logprobs): log_softmax of the
target's raw logits at the emitting position, before temperature, top-k, top-p or min-p.
So a token's logprob is the same with speculation on or off and whatever the sampling
settings, and under greedy decoding the chosen token is always the top alternative.
The chosen token's logprob and the alternatives are read from the same tensor, so a
chosen token listed among the alternatives carries exactly the same value there.
"""
from __future__ import annotations

import torch

from specd.engine.scheduler import ScheduledSeq
from specd.engine.sequence import Sequence


class StepLogprobs:
    """The logprob rows of one step's logits; computed only when a request in the batch asks."""

    def __init__(self, batch: list[ScheduledSeq], logits: torch.Tensor):
        """logits [Σ num_logits, V] float32, rows in batch order (prefill-only entries have none)."""
        wanting = [e.seq.params for e in batch if e.num_logits and e.seq.params.want_logprobs]
        self.rows = logits.log_softmax(dim=-1) if wanting else None  # [Σ num_logits, V]
        # One top-k over every row for the largest request, then sliced per request: a single
        # kernel and host copy per step. Nothing at all when no request wants alternatives.
        k = min(max((p.num_top_logprobs for p in wanting), default=0), logits.shape[-1])
        self.top_ids: list[list[int]] = []
        self.top_values: list[list[float]] = []
        if k and self.rows is not None:
            values, ids = self.rows.topk(k, dim=-1)  # [Σ num_logits, k], sorted descending
            self.top_values, self.top_ids = values.tolist(), ids.tolist()

    def record(self, seq: Sequence, row: int, token: int) -> None:
        """Append the logprob (and alternatives) of `token`, emitted from logits row `row`.

        With speculation an entry's rows are [last token, d1 .. dk]: emitted token j was drawn
        from row j of the entry (the target's distribution after drafts 1..j were accepted).
        """
        if self.rows is None or not seq.params.want_logprobs:
            return
        seq.output_logprobs.append(self.rows[row, token].item())
        n = seq.params.num_top_logprobs
        if n:
            seq.output_top_logprobs.append((self.top_ids[row][:n], self.top_values[row][:n]))
