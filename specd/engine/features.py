"""The target's hidden states of one sequence, kept for hidden-state drafters.

One row per committed position whose forward has run (the row of position p is the state
that predicted token p + 1; see specd/proposers/base.py). Rows are written when a step is
committed: a prefill chunk's rows, or a decode step's rows for its last token and the drafts
that were accepted (rejected drafts' rows are dropped with their KV). Kept for the whole
sequence, so a drafter that lost its state is resynced from here without recomputing.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the scheduler imports this and stays torch-free
    import torch


class FeatureRows:
    def __init__(self):
        self.data: torch.Tensor | None = None  # [capacity, F]
        self.num_rows = 0  # rows [0, num_rows) are valid
        self.layers: tuple[int, ...] = ()  # whose states the columns hold

    def write(self, start: int, rows: torch.Tensor, layers: tuple[int, ...]) -> None:
        """Rows for positions [start, start + len(rows)); what lay beyond them is dropped.
        Rows that would leave a gap are not kept: after the captured layers change (a drafter
        with other layers registered) a sequence has features again only once recomputed."""
        end = start + rows.shape[0]
        if layers != self.layers:
            self.data, self.num_rows, self.layers = None, 0, layers
        if start > self.num_rows:
            return
        if self.data is None:
            self.data = rows.new_empty((max(end, 64), rows.shape[1]))
        elif end > self.data.shape[0]:  # grow by doubling: amortised O(1) per row
            grown = self.data.new_empty((max(end, 2 * self.data.shape[0]), self.data.shape[1]))
            grown[: self.num_rows] = self.data[: self.num_rows]
            self.data = grown
        self.data[start:end] = rows
        self.num_rows = end

    def rows(self, start: int, end: int) -> torch.Tensor:
        if not 0 <= start <= end <= self.num_rows:
            raise IndexError(f"feature rows [{start}, {end}) asked for, [0, {self.num_rows}) held")
        return self.data[start:end]
