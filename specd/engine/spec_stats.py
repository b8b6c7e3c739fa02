"""Speculation counters, in the form operators chart (vLLM's spec_decode metrics).

Raw counts only: acceptance rate = accepted / draft_tokens; mean acceptance length
= 1 + accepted / drafts. A request that never speculated has all zeros.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    drafts: int = 0  # verify steps that carried at least one draft token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i
    cached_drafts: int = 0  # of `drafts`, drafted ahead by a pipelined drafter (draft-cache hits)
    by_drafter: dict[str, int] = field(default_factory=dict)  # of `drafts`, per drafter that made them

    def observe_draft(self, num_draft: int, num_accepted: int, cached: bool = False, drafter: str | None = None) -> None:
        if num_draft == 0:
            return
        self.drafts += 1
        if drafter:
            self.by_drafter[drafter] = self.by_drafter.get(drafter, 0) + 1
        self.cached_drafts += cached
        self.draft_tokens += num_draft
        self.accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft:
            self.accepted_per_pos.extend([0] * (num_draft - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    def to_dict(self) -> dict:
        return {"drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "accepted_per_pos": list(self.accepted_per_pos), "cached_drafts": self.cached_drafts,
                "drafts_by_drafter": dict(self.by_drafter)}
