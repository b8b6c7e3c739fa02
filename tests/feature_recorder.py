"""A proposer that checks the hidden-state contract (specd/proposers/base.py) from the
receiving side, for the engine's and the drafter service's feature tests.

It drafts the reference continuation for two tokens and then a wrong one, so steps see
accepted and rejected drafts, and keeps every feature row it is sent by sequence (found by
its history, so it works behind a drafter service's internal ids) and absolute position.
"""
from __future__ import annotations

import torch

from specd.proposers.base import Proposal, feature_rows


class FeatureRecorder:
    def __init__(self, layers: tuple[int, ...], references: list[list[int]], vocab: int, hidden_size: int = 0,
                 target_layers: int = 0):
        self.feature_layers, self.hidden_size, self.target_layers = layers, hidden_size, target_layers
        self.references, self.vocab = references, vocab  # full greedy token sequences
        self.rows: dict[int, dict[int, torch.Tensor]] = {}  # reference index -> position -> row
        self.which: dict[int, int] = {}  # seq id -> reference index
        self.requests: list[tuple[bool, int, int, int, int]] = []  # full, new tokens, rows, wanted rows, k

    def propose(self, batch):
        out = []
        for req in batch:
            rows = 0 if req.features is None else req.features.shape[0]
            self.requests.append((req.full_history, len(req.new_tokens), rows, feature_rows(req), req.k))
            if req.full_history:
                self.which[req.seq_id] = next(i for i, r in enumerate(self.references)
                                              if r[:req.num_tokens] == list(req.new_tokens))
            ref_index = self.which[req.seq_id]
            first = req.num_tokens - len(req.new_tokens) + (1 if req.full_history else 0)  # token row 0 predicted
            seen = self.rows.setdefault(ref_index, {})
            for j in range(rows):
                seen[first + j - 1] = req.features[j].clone()  # the row of position p predicted token p + 1
            ref, n = self.references[ref_index], req.num_tokens
            drafts = ref[n: n + min(2, req.k)]
            if len(drafts) < req.k and n + len(drafts) < len(ref):
                drafts.append((ref[n + len(drafts)] + 1) % self.vocab)  # wrong: rejected
            out.append(Proposal(seq_id=req.seq_id, token_ids=drafts))
        return out

    def release(self, seq_ids):
        pass


def hf_features(model, ids: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """transformers' hidden states at `layers` for every position of ids, concatenated [len, len(layers) * H]."""
    with torch.no_grad():
        hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([hs[j][0] for j in layers], dim=-1)
