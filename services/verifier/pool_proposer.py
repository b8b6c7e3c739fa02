"""The drafter pool's synchronous face: the engine's proposer, called on the engine thread, run on
the event loop that owns the pool's streams."""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from specd.proposers.base import Proposal, ProposeRequest

if TYPE_CHECKING:
    from specd.verifier.drafter_pool import DrafterPool

log = logging.getLogger("specd.verifier.pool")


class PoolProposer:
    """The engine's proposer interface, called from the engine thread, run on the event loop."""

    def __init__(self, pool: DrafterPool, loop: asyncio.AbstractEventLoop):
        self.pool, self.loop = pool, loop

    def propose(self, batch: list[ProposeRequest]) -> list[Proposal]:
        future = asyncio.run_coroutine_threadsafe(self.pool.propose(batch), self.loop)
        try:  # the pool keeps its own deadlines; this bound only guards against a stuck loop
            return future.result(timeout=self.pool.timeout_s * 4 + 1.0)
        except TimeoutError:
            future.cancel()
            log.error("drafter pool did not answer within %.1f s; stepping without drafts",
                      self.pool.timeout_s * 4 + 1.0)
            return []

    def release(self, seq_ids: list[int]) -> None:
        self.loop.call_soon_threadsafe(self.pool.release, list(seq_ids))

    @property
    def inline_drafters(self) -> dict:
        """The pool's local drafters: the speculator asks them itself, on the engine thread."""
        return self.pool.local

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.pool.feature_layers

    @property
    def drafter_names(self) -> list[str]:
        """Healthy drafters, the default first: what the speculation controller chooses among."""
        return self.pool.healthy_names()

    def pinned_drafter(self, seq_id: int) -> str | None:
        return self.pool.seq_choice.get(seq_id)

    @property
    def reading_histories(self) -> bool:
        """Whether a drafter service still reads new histories in the background (DrafterClient.catching_up)."""
        return any(c.catching_up for c in list(self.pool.drafters.values()))

    def one_forward_of(self, name: str) -> bool:
        return self.pool.one_forward_of(name)
