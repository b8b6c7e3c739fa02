"""What a Propose round trip may carry: a request's features cut to the message bound
(MAX_FEATURE_BYTES), a drafter's reply held to the protocol's bounds (docs/architecture.md, "Services")."""
from __future__ import annotations

import logging
from dataclasses import replace

from specd.config import MAX_TREE_NODES
from specd.proposers.base import Proposal, ProposeRequest
from specd.rpc.wire import MAX_FEATURE_BYTES, proposal_from_proto
from specd.verifier.drafter_client import DrafterClient

log = logging.getLogger("specd.verifier.pool")  # the pool's: a dropped proposal is the pool's event

# The widest sparse q a drafter may send per draft (draft_model sends its draft top-k, 16 by default).
MAX_Q_WIDTH = 256


def wire_pieces(req: ProposeRequest, layers: tuple[int, ...], max_bytes: int | None = None) -> list[ProposeRequest]:
    """req as a drafter wanting `layers` gets it: only those feature columns (none for a
    token-only drafter), split into pieces of at most max_bytes (MAX_FEATURE_BYTES) of features.
    Row j of req.features is the state that predicted token `first + j` (first = features_from + 1
    for a full history, else the first new token), so pieces cut the tokens and the rows at the
    same place."""
    if not layers or req.features is None:
        return [replace(req, features=None, feature_layers=())]
    rows = req.features
    if tuple(layers) != tuple(req.feature_layers):
        hidden = rows.shape[1] // len(req.feature_layers)
        cols = [req.feature_layers.index(j) for j in layers]
        rows = rows.view(rows.shape[0], len(req.feature_layers), hidden)[:, cols].reshape(rows.shape[0], -1)
    max_rows = max(1, (max_bytes or MAX_FEATURE_BYTES) // (rows.shape[1] * rows.element_size()))
    start = req.num_tokens - len(req.new_tokens)  # position of new_tokens[0]
    first = req.features_from + 1 if req.full_history else start  # token predicted by row 0
    out, tok, row = [], start, 0
    while True:
        end_row = min(row + max_rows, rows.shape[0])
        end_tok = first + end_row  # tokens up to the last one these rows predicted
        last = end_row == rows.shape[0]
        out.append(replace(req, new_tokens=req.new_tokens[tok - start: (req.num_tokens if last else end_tok) - start],
                           num_tokens=req.num_tokens if last else end_tok, full_history=req.full_history and not out,
                           features_from=req.features_from if req.full_history and not out else 0,
                           features=rows[row:end_row], feature_layers=tuple(layers)))
        if last:
            return out
        tok, row = end_tok, end_row


def checked_reply(client: DrafterClient, requests: list[ProposeRequest], reply) -> list[Proposal]:
    """The reply within the protocol's bounds (_in_bounds), looked at through len() before
    anything is copied: one proposal per sequence asked. A proposal out of bounds is dropped
    (a violation); ids, q values and a tree's budget and depth are checked by the speculator.
    An untrusted drafter's q is dropped unread: its drafts are verified as one-hot, which is
    exact whoever chose them."""
    asked = {r.seq_id: min(r.k, client.max_k) for r in requests}
    out, seen, violations = [], set(), 0
    for p in reply.proposals:
        k = asked.get(p.seq_id)
        if k is None or p.seq_id in seen or not _in_bounds(p, k, client.trusted):
            violations += 1
            continue
        seen.add(p.seq_id)
        out.append(proposal_from_proto(p, client.name, use_q=client.trusted and len(p.q) > 0))
    if violations:
        client.violations += violations
        log.warning("drafter %s: %d proposal(s) out of bounds dropped", client.name, violations)
    return out


def _in_bounds(p, k: int, trusted: bool) -> bool:
    """A wire proposal's shape: at most k drafts (a tree: MAX_TREE_NODES, one parent each), q one
    row per draft, each row at most MAX_Q_WIDTH wide where it will be read."""
    n, tree = len(p.token_ids), len(p.parents) > 0
    return (n <= (MAX_TREE_NODES if tree else k) and (not tree or len(p.parents) == n)
            and (not len(p.q) or len(p.q) == n) and not (trusted and any(len(d.ids) > MAX_Q_WIDTH for d in p.q)))
