"""A request inside the engine: its tokens, KV block table, progress and outcome."""
from __future__ import annotations

import enum
import itertools
from typing import Any

from specd.engine.spec_stats import SpecStats
from specd.sampling import SamplingParams

_ids = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, seq_id: int | None = None):
        self.seq_id = next(_ids) if seq_id is None else seq_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[float] = []
        # Per output token when params.num_top_logprobs > 0: (token ids, logprobs), most likely first.
        self.output_top_logprobs: list[tuple[list[int], list[float]]] = []
        self.params = params
        self.status = SeqStatus.WAITING
        # Invariant: the KV of token_ids[:num_computed_tokens] is in the blocks of block_table.
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        # Prefix cache (specd/engine/block_manager.py): content hashes of full blocks of token_ids
        # (kept across preemption: they depend on the tokens only), and how many of block_table's
        # blocks are in the cache.
        self.block_hashes: list[bytes] = []
        self.num_cached_blocks = 0
        self.num_cached_tokens = 0  # prompt tokens whose KV came from the cache at admission
        self.finish_reason: str | None = None
        self.generator: Any = None  # per-request seeded RNG, owned by the sampler side
        self.stop_checker: Any = None  # specd.models.detokenizer.StopChecker when params.stop is set
        self.spec_stats = SpecStats()
        self.spec_sent = 0  # committed tokens already sent to the proposer (0: send full history)
        self.spec_features_from: int | None = None  # a full history's first feature row, once a head said
        self.features: Any = None  # specd.engine.features.FeatureRows when a drafter wants hidden states
        # llguidance's matcher when params.structured_outputs is set: the grammar state after the
        # committed output tokens (specd/engine/grammar.py).
        self.matcher: Any = None
        # n > 1: the other n - 1 sequences of the request, waiting for this one's prompt; forked from it
        # (its prompt KV shared, its last prompt row's logits sampled by each) in the step that computes
        # the prompt's last token (LLMEngine._fork).
        self.forks: list[Sequence] = []

    @property
    def token_ids(self) -> list[int]:
        """All tokens, as a new O(L) list: the hot path uses token_slice instead."""
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building the whole list."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:end] + self.output_token_ids[:max(0, end - p)]

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED

    def __repr__(self) -> str:
        return f"Sequence(id={self.seq_id}, len={len(self)}, computed={self.num_computed_tokens}, {self.status.value})"
