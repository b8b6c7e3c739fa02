"""The proposer contract: propose(batch of ProposeRequest) -> Proposal per request, release(ids).

It lives with its caller, the engine's speculator: proposers (specd/proposers/, found through
the PROPOSERS registry there) implement it, and the engine never imports one. Their per-sequence
state is keyed by sequence id and fed only committed tokens (drafts that were not
accepted never reach it, so there is nothing speculative to undo). A request that
does not line up with what the proposer knows is answered with resync=True, and the
caller sends the full history next time.

Hidden-state proposers (EAGLE, EAGLE-3, Medusa, MLP speculator) also get the target's
features. A proposer that wants them has `feature_layers`: indices in Hugging Face's
`output_hidden_states` convention for a target with L decoder layers (0 = the embeddings,
j < L = the residual stream entering layer j, i.e. leaving layer j-1, L = the final normed
state, the LM head's input). EAGLE, Medusa and MLP speculators use (L,); EAGLE-3 uses
(2, L // 2, L - 3). Row i of ProposeRequest.features is the target's state at the position
before new_tokens[i], the state that predicted it, with the requested layers concatenated
in order. The first token of a history has no predicting state, so a full history has one
row fewer than tokens; after that, one row per new token. A full history may carry fewer rows
(features_from): the head keeps its state over a prefix it has seen (its prefix cache) and
needs rows only past it; one that lacks them answers resync with history_held, and the next
full history's rows start there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


@dataclass
class ProposeRequest:
    seq_id: int
    new_tokens: list[int]  # committed since the last request (the full history when full_history)
    num_tokens: int  # total committed length after appending new_tokens
    k: int  # max drafts wanted (0 = none)
    full_history: bool = False  # first contact, resync, or a rollback of committed history
    temperature: float = 0.0  # drafter-side sampling (draft_model only)
    seed: int | None = None
    num_prompt_tokens: int | None = None  # optional; suffix caches the tokens after the prompt
    # [rows, len(feature_layers) * hidden]: the target's features for new_tokens (module docstring);
    # None for token-only proposers.
    features: torch.Tensor | None = None
    feature_layers: tuple[int, ...] = ()  # the layers of features' columns, in order
    # Pipelined drafting (specd/proposers/pipeline.py). tentative: draft as if new_tokens were
    # committed, and leave the state as it was (a guess at the outcome of the step being verified).
    tentative: bool = False
    # Also report, per draft, the drafter's probability of it and its `alternatives` next-best
    # tokens (Proposal.draft_probs, .alternatives), and for chain heads the states it drafted from.
    alternatives: int = 0
    # A verifier's pool: the drafter the speculation controller chose for this sequence
    # (None: the pool's default); a request that named its own drafter keeps it.
    drafter: str | None = None
    # With full histories of a constrained request: its StructuredOutput as JSON, so a model
    # drafter can mask its own drafts (specd/proposers/draft_grammar.py).
    structured_outputs: str | None = None
    # A full history's feature rows start at the pair that predicted token features_from + 1 (0: all
    # rows); a head holds the pairs before it in its prefix cache, or answers resync, history_held.
    features_from: int = 0
    # With a full history: False when the request asked that its answer not be kept in a cache of
    # finished answers that later requests draft from (the suffix index's global cache).
    cache_output: bool = True
    # An in-process index with several sources (Proposal.source): the ones not to ask this step,
    # whose drafts the controller has found cannot pay at this batch size (a datastore lookup costs
    # ~0.1 ms: asked for 32 sequences a step, most of what its drafts could save). Never sent over the wire.
    skip_sources: frozenset[str] = frozenset()


def drafting_temperature(params) -> float:
    """The temperature drafters get: 0 for a greedy request, whatever its temperature field says
    (top_k 1 at T 0.7 is greedy: SamplingParams.greedy is the one definition), so a drafter plans
    and drafts it as the verifier verifies it."""
    return 0.0 if params.greedy else params.temperature


@dataclass
class Proposal:
    seq_id: int
    token_ids: list[int]
    q_ids: list[list[int]] | None = None  # sparse q per position; None: deterministic (one-hot)
    q_probs: list[list[float]] | None = None
    # A token tree: the parent of each draft (-1: the last committed token), pointing backwards,
    # q per node where sampled; None: a chain (parents -1, 0, 1, ...).
    parents: list[int] | None = None
    resync: bool = False
    history_held: int = 0  # with resync after a late features_from: leading pairs the head holds
    drafter: str | None = None  # set by the verifier's drafter pool: which service answered
    cached: bool = False  # pipelined drafting: drafted ahead, taken from the draft cache
    # A verifier's pool: the history went to the drafter, which takes it in the background (it is
    # catching up on a new sequence's history); no drafts this step, and no resync either.
    deferred: bool = False
    # An in-process index with several sources (the suffix index: "own" history, the answer "cache",
    # a "datastore"): which one drafted. The controller keeps their acceptance apart; never sent
    # over the wire.
    source: str = ""
    # Asked for with ProposeRequest.alternatives (chains only), never sent over the wire:
    draft_probs: list[float] | None = None  # the drafter's probability of each draft
    alternatives: list[list[tuple[int, float]]] | None = None  # per draft: next-best (token, prob)
    # Chain heads: the state each draft was drafted from (the head's stand-in for the target's
    # feature row that will predict that token), [len(token_ids), width].
    draft_features: torch.Tensor | None = None


class Proposer(Protocol):
    def propose(self, batch: list[ProposeRequest]) -> list[Proposal]: ...

    def release(self, seq_ids: list[int]) -> None: ...
