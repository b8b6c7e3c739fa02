"""Continuous batching under a token budget, with chunked prefill and preemption, and what a
step's output does to the sequences.

Plain Python over Sequence objects (no torch), so it is unit-tested alone.
Each step: running sequences first (in arrival order), then waiting ones (FCFS); a waiting
sequence starts from the cached KV of its longest cached prefix (block_manager.py).
When KV blocks run out, the most recently arrived running sequence is preempted:
its blocks are freed (full ones stay cached) and it is recomputed later from its prompt + outputs.
attach_drafts puts a step's drafts into its batch (their KV blocks allocated here);
postprocess commits the sampled tokens: KV commit and rollback, stops, logprobs.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Protocol

from specd.engine.block_manager import BlockManager
from specd.engine.features import FeatureRows
from specd.engine.sequence import Sequence, SeqStatus

if TYPE_CHECKING:
    import torch


@dataclass
class Drafts:
    """A proposer's drafts for one sequence, as the speculator hands them to the scheduler."""

    token_ids: list[int]
    q: list[tuple[list[int], list[float]]] | None = None  # sparse q per draft: (ids, probs); None: one-hot
    drafter: str | None = None  # who proposed them (per-drafter acceptance counters)
    # A token tree: the parent of each draft (-1: the last committed token), pointing backwards.
    # None: a chain (parents -1, 0, 1, ...).
    parents: list[int] | None = None
    cached: bool = False  # pipelined drafting: drafted ahead (a draft-cache hit)
    offered: int = 0  # drafted before the plan (an in-process index): the length offered, before the cut at k
    source: str = ""  # and which of the index's sources drafted it (Proposal.source)


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens whose KV this step computes: token_ids[computed : computed + n]
    num_logits: int  # logits wanted at the last num_logits of those positions (0 = mid-prefill chunk)
    # Set by attach_drafts: the forward then covers [last token, *drafts], all with logits.
    drafts: Drafts | None = None
    # Token trees (specd/engine/model/attention.py): the tokens from tree_base on form a tree; the
    # parent of each, relative to tree_base (-1: the context before it). None: causal.
    tree_base: int | None = None
    tree_parents: list[int] | None = None

    @property
    def draft_token_ids(self) -> list[int]:
        return self.drafts.token_ids if self.drafts is not None else []


class LogprobsRecorder(Protocol):  # specd.engine.logprobs.StepLogprobs
    def record(self, seq: Sequence, row: int, token: int) -> None: ...


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, eos_token_ids: Iterable[int] = (),
                 max_model_len: int | None = None):
        self.blocks = block_manager
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Hidden-state drafters (set by the engine): the target layers they read. A cached block
        # keeps the committed rows of those layers beside its KV, so a prefix hit gives a sequence
        # its features too; a block cached without them is not a hit while they are wanted.
        self.feature_layers: tuple[int, ...] = ()
        self._block_features: dict[int, tuple[tuple[int, ...], torch.Tensor]] = {}
        block_manager.on_evict = lambda block: self._block_features.pop(block, None)

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
            prefix = self._usable_prefix(seq, self.blocks.match_prefix(seq))
            cached = len(prefix) * self.blocks.block_size
            n = len(seq) - cached - seq.num_computed_tokens
            if n > budget and not self.enable_chunked_prefill:
                break
            n = min(n, budget)
            if not self.blocks.allocate(seq, cached + seq.num_computed_tokens + n, prefix):
                break  # FCFS: never let a later request jump ahead of one waiting for blocks
            if prefix:
                self._restore_features(seq, prefix)
            if not seq.output_token_ids:
                seq.num_cached_tokens = cached
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            batch.append(self._entry(seq, n))
            budget -= n
        return batch

    def start(self, seq: Sequence) -> None:
        """Run a sequence that holds its KV already (a fork of another's prompt)."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def attach_drafts(self, batch: list[ScheduledSeq], drafts: dict[int, Drafts]) -> None:
        """Give each decoding entry its drafts (by seq_id) and the KV blocks they need; an entry
        whose blocks cannot be had stays without drafts (it still decodes its one token)."""
        for e in batch:
            d = drafts.get(e.seq.seq_id)
            if d is None or not d.token_ids or e.num_new_tokens != 1 or e.num_logits != 1:
                continue
            if self.blocks.allocate(e.seq, e.seq.num_computed_tokens + 1 + len(d.token_ids)):
                e.drafts = d
                e.num_new_tokens = e.num_logits = 1 + len(d.token_ids)
                if d.parents is not None:  # the tree's root is the last committed token
                    e.tree_base = e.seq.num_computed_tokens
                    e.tree_parents = [-1] + [p + 1 for p in d.parents]

    def postprocess(self, batch: list[ScheduledSeq], sampled: list[list[int]],
                    logprobs: LogprobsRecorder | None = None, features: torch.Tensor | None = None,
                    feature_layers: tuple[int, ...] = (), paths: list[list[int] | None] | None = None,
                    copy_kv: Callable[[list[int], list[int]], None] | None = None) -> list[Sequence]:
        """Commit a step: sampled[i] are the tokens of the i-th entry with logits (accepted
        drafts, then one). features: the step's captured hidden states [T, F] of
        feature_layers, one row per forwarded token in batch order; the committed positions'
        rows are kept with their KV. paths[i]: for a token tree, the accepted nodes (draft
        indices, root first); their KV moves to consecutive positions through copy_kv(src
        slots, dst slots) (the model runner's), before rejected blocks are freed.
        Returns the sequences that finished in it."""
        finished, stops, row, i, token_row = [], [], 0, 0, 0
        moves: tuple[list[int], list[int]] = ([], [])
        rollback: list[Sequence] = []
        for entry in batch:
            seq, start = entry.seq, entry.seq.num_computed_tokens
            committed = entry.num_new_tokens
            path = None
            if entry.num_logits:
                tokens = sampled[i]
                path = paths[i] if paths is not None and entry.tree_parents is not None else None
                # KV is valid for the last committed token plus the accepted drafts; rejected
                # slots are rolled back (the newest token's KV is computed next step).
                committed -= len(entry.draft_token_ids) - (len(tokens) - 1)
            # Forward rows of the committed positions: the root, then the accepted path (a fork that
            # computed nothing samples from its one row: LLMEngine._fork).
            kept = (list(range(committed)) or [0]) if path is None else [0] + [n + 1 for n in path]
            if path is not None:
                for j, r in enumerate(kept):
                    if r != j:  # a node off the first branch: its KV goes to position start + j
                        moves[0].append(self._slot(seq, start + r))
                        moves[1].append(self._slot(seq, start + j))
            seq.num_computed_tokens += committed
            if committed < entry.num_new_tokens:
                rollback.append(seq)
            if features is not None:
                if seq.features is None:
                    seq.features = FeatureRows()
                rows = features[token_row: token_row + committed] if path is None else \
                    features[[token_row + r for r in kept]]
                seq.features.write(start, rows, feature_layers)
            token_row += entry.num_new_tokens
            if not entry.num_logits:
                continue
            for j, token in enumerate(tokens):
                seq.output_token_ids.append(token)
                if logprobs is not None:  # emitted token j comes from the row of the j-th kept position
                    logprobs.record(seq, row + kept[j], token)
                reason = self._stop_reason(seq, token)
                if reason:  # a stop inside accepted drafts ends the sequence right there
                    stops.append((seq, reason))
                    finished.append(seq)
                    break
            row += entry.num_logits
            i += 1
        if moves[0] and copy_kv is not None:
            copy_kv(*moves)
        for seq, reason in stops:  # after the tree's KV commit: its full blocks are cached as they are
            # Drafts accepted past the stop computed KV for tokens the sequence does not keep: a
            # block holding them must not enter the prefix cache (nor be hashed from tokens it lacks).
            seq.num_computed_tokens = min(seq.num_computed_tokens, len(seq))
            self.finish(seq, reason)
        for seq in rollback:  # rejected slots, after the KV commit read them (finished: already freed)
            self.blocks.truncate(seq, seq.num_computed_tokens)
        for entry in batch:
            if entry.seq.status == SeqStatus.RUNNING:
                self._cache_blocks(entry.seq)
        return finished

    # -- prefix cache --------------------------------------------------------
    def _cache_blocks(self, seq: Sequence) -> None:
        """Put seq's newly full blocks into the prefix cache, with their feature rows when wanted."""
        for index, block in self.blocks.commit(seq):
            f = seq.features
            end = (index + 1) * self.blocks.block_size
            if self.feature_layers and f is not None and f.layers == self.feature_layers and f.num_rows >= end:
                self._block_features[block] = (f.layers, f.rows(end - self.blocks.block_size, end).clone())

    def _usable_prefix(self, seq: Sequence, prefix: list[int]) -> list[int]:
        """The hit, cut where a hidden-state drafter would lack features: at the first block
        cached without them (unless seq still has its own, e.g. after preemption)."""
        if self._has_features(seq, len(prefix) * self.blocks.block_size):
            return prefix
        for n, block in enumerate(prefix):
            kept = self._block_features.get(block)
            if kept is None or kept[0] != self.feature_layers:
                return prefix[:n]
        return prefix

    def _has_features(self, seq: Sequence, num_tokens: int) -> bool:
        """No drafter wants features, or seq holds its own for its first num_tokens positions."""
        f = seq.features
        return not self.feature_layers or (f is not None and f.layers == self.feature_layers
                                           and f.num_rows >= num_tokens)

    def _restore_features(self, seq: Sequence, prefix: list[int]) -> None:
        if self._has_features(seq, len(prefix) * self.blocks.block_size):
            return
        import torch

        if seq.features is None:
            seq.features = FeatureRows()
        seq.features.write(0, torch.cat([self._block_features[b][1] for b in prefix]), self.feature_layers)

    def _slot(self, seq: Sequence, pos: int) -> int:
        bs = self.blocks.block_size
        return seq.block_table[pos // bs] * bs + pos % bs

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        if seq.stop_checker is not None and seq.stop_checker.add(token):
            return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or (
                self.max_model_len is not None and len(seq) >= self.max_model_len):
            return "length"
        return None

    @staticmethod
    def _entry(seq: Sequence, n: int) -> ScheduledSeq:
        # Only a chunk that reaches the end of the known tokens yields a next token.
        return ScheduledSeq(seq, n, 1 if seq.num_computed_tokens + n == len(seq) else 0)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._cache_blocks(seq)
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
        try:
            self._cache_blocks(seq)  # a finished turn's KV serves the conversation's next request
        finally:  # whatever caching did, the blocks go back
            self.blocks.free(seq)
            seq.status = SeqStatus.FINISHED
            seq.finish_reason = reason
