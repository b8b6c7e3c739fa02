"""Continuous batching under a token budget, with chunked prefill and preemption.

Plain Python over Sequence objects (no torch), so it is unit-tested alone.
Each step: running sequences first (in arrival order), then waiting ones (FCFS).
When KV blocks run out, the most recently arrived running sequence is preempted:
its blocks are freed and it is recomputed later from its prompt + outputs.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specd.engine.block_manager import BlockManager
from specd.engine.sequence import Sequence, SeqStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens whose KV this step computes: token_ids[computed : computed + n]
    num_logits: int  # logits wanted at the last num_logits of those positions (0 = mid-prefill chunk)
    # Speculation fills these after scheduling: the forward then covers [last token, *drafts].
    draft_token_ids: list[int] = field(default_factory=list)
    draft_q: list | None = None  # sparse q per draft: (ids, probs); None = deterministic drafts
    drafter: str | None = None  # who proposed the drafts (per-drafter acceptance counters)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True):
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.blocks.allocate(seq, seq.num_computed_tokens + n):
                # Free the newest running sequence; if that is seq itself, it waits.
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status != SeqStatus.RUNNING:
                continue  # seq was preempted and left self.running; same index is the next one
            batch.append(self._entry(seq, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = seq.num_uncomputed_tokens
            if n > budget and not self.enable_chunked_prefill:
                break
            n = min(n, budget)
            if not self.blocks.allocate(seq, seq.num_computed_tokens + n):
                break  # FCFS: never let a later request jump ahead of one waiting for blocks
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            batch.append(self._entry(seq, n))
            budget -= n
        return batch

    @staticmethod
    def _entry(seq: Sequence, n: int) -> ScheduledSeq:
        # Only a chunk that reaches the end of the known tokens yields a next token.
        return ScheduledSeq(seq, n, 1 if seq.num_computed_tokens + n == len(seq) else 0)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
