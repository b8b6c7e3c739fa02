"""One token tree from several proposers' drafts, e.g. draft_model + suffix (method "combined").

A model drafter guesses well in open prose; suffix and n-gram lookup guess long runs where
the answer repeats text. Each member sees every request and keeps its own state; their
chains and trees are merged into one trie per sequence (equal tokens under the same parent
become one node, so their continuations share it), and the verifier walks the tree as any
other (specd/kernels/tree_rejection_sampler.py).

Exactness: the merged tree is sent without q, so every node is verified as one-hot. A draft
verified as one-hot keeps the target's distribution whoever chose it, as long as the choice
does not depend on the acceptance uniforms, which drafters never see. Merging equal siblings
loses nothing either: with one-hot q a rejected token has no mass left in the residual, so an
equal sibling after it would be rejected for sure and leave the residual as it was.

Member order is priority: the first member's nodes are tried first, and kept first when the
node budget cuts the tree.
"""
from __future__ import annotations

from dataclasses import replace

from specd.proposers.base import Proposal, ProposeRequest


class CombinedProposer:
    def __init__(self, members: list, max_nodes: int):
        self.members, self.max_nodes = members, max_nodes
        wanted = {tuple(getattr(m, "feature_layers", None) or ()) for m in members} - {()}
        if len(wanted) > 1:
            raise ValueError("members of 'combined' must not read different target layers "
                             f"(they ask for {sorted(wanted)})")
        self._reader = next((m for m in members if getattr(m, "feature_layers", None)), None)
        self.feature_layers = tuple(self._reader.feature_layers) if self._reader else ()
        self.vocab_size = next((m.vocab_size for m in members if getattr(m, "vocab_size", None)), None)
        # The longest history every member drafts for (a draft model's context; None: no bound).
        self.max_model_len = min((m.max_model_len for m in members if getattr(m, "max_model_len", None)),
                                 default=None)

    # A hidden-state member's Info (services/drafter/main.py describes the combined drafter with it).
    @property
    def hidden_size(self) -> int:
        return self._reader.hidden_size

    @property
    def target_layers(self) -> int:
        return self._reader.target_layers

    @property
    def target_fingerprint(self) -> str:
        return getattr(self._reader, "target_fingerprint", "") or ""

    def propose(self, batch: list[ProposeRequest]) -> list[Proposal]:
        answers = [m.propose(batch if getattr(m, "feature_layers", None) else [_tokens_only(r) for r in batch])
                   for m in self.members]
        by_member = [{p.seq_id: p for p in ps} for ps in answers]
        out = []
        for r in batch:
            props = [b.get(r.seq_id) for b in by_member]
            if any(p is None or p.resync for p in props):
                # A member lost this sequence: the full history goes to all of them next time
                # (a full history resets the others, which costs nothing but that step's drafts).
                out.append(Proposal(seq_id=r.seq_id, token_ids=[], resync=True))
                continue
            tokens, parents = merge_trees([(p.token_ids, p.parents) for p in props], self.max_nodes)
            chain = parents == list(range(-1, len(tokens) - 1))
            out.append(Proposal(seq_id=r.seq_id, token_ids=tokens, parents=None if chain else parents))
        return out

    def release(self, seq_ids: list[int]) -> None:
        for m in self.members:
            m.release(seq_ids)


def _tokens_only(r: ProposeRequest) -> ProposeRequest:
    return replace(r, features=None, feature_layers=()) if r.features is not None else r


def merge_trees(trees: list[tuple[list[int], list[int] | None]], max_nodes: int) -> tuple[list[int], list[int]]:
    """Trie merge of trees given as (tokens, parents; None = a chain), in order, up to max_nodes
    nodes. -> (tokens, parents) with parents pointing backwards (-1: the last committed token)."""
    tokens: list[int] = []
    parents: list[int] = []
    child: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for toks, pars in trees:
        pars = pars if pars is not None else list(range(-1, len(toks) - 1))
        mapped: list[int | None] = []  # this tree's node i -> merged node (None: cut by the budget)
        for t, p in zip(toks, pars):
            parent = -1 if p < 0 else mapped[p]
            if parent is None:
                mapped.append(None)
                continue
            node = child.get((parent, t))
            if node is None and len(tokens) < max_nodes:
                node = child[(parent, t)] = len(tokens)
                tokens.append(t)
                parents.append(parent)
            mapped.append(node)
    return tokens, parents
