"""Every conversion of the drafter hop lives in specd/rpc/wire.py and round-trips: a ProposeRequest
through a ProposeEntry (the verifier writes, the drafter reads), a Proposal through the proto's
Proposal (the drafter writes, the verifier reads), each through the wire bytes."""
from __future__ import annotations

from dataclasses import fields

import torch

from specd.engine.spec.proposal import Proposal, ProposeRequest
from specd.rpc.wire import (proposal_from_proto, proposal_to_proto, propose_entry_to_proto,
                            propose_request_from_proto, tensor_from_proto)
from specd.v1 import drafter_pb2


def _through_wire(request: ProposeRequest, k: int) -> ProposeRequest:
    batch = drafter_pb2.ProposeBatch()
    sent = propose_entry_to_proto(batch, request, k)
    (entry,) = drafter_pb2.ProposeBatch.FromString(batch.SerializeToString()).entries
    features = tensor_from_proto(entry.features) if entry.HasField("features") else None
    assert sent == (len(entry.features.data) if features is not None else 0)
    return propose_request_from_proto(entry, request.seq_id, k, features)


def test_propose_requests_round_trip():
    full = ProposeRequest(seq_id=7, new_tokens=[1, 2, 3, 4], num_tokens=4, k=5, full_history=True, num_prompt_tokens=2,
                          temperature=0.75, seed=123, features=torch.randn(3, 8), structured_outputs='{"json": {}}',
                          features_from=0, cache_output=False)
    delta = ProposeRequest(seq_id=9, new_tokens=[5], num_tokens=12, k=3, temperature=0.0)
    for r in (full, delta):
        back = _through_wire(r, r.k)
        for f in fields(ProposeRequest):
            a, b = getattr(r, f.name), getattr(back, f.name)
            if f.name == "features":
                assert (a is None and b is None) or torch.equal(a, b)
            elif f.name in ("feature_layers", "drafter", "skip_sources"):  # the verifier's own bookkeeping
                continue
            else:
                assert a == b, (f.name, a, b)


def test_proposals_round_trip_and_q_only_from_the_trusted():
    chain = Proposal(seq_id=4, token_ids=[10, 11], q_ids=[[10, 3], [11]], q_probs=[[0.75, 0.25], [1.0]],
                     history_held=40, cached=True)
    tree = Proposal(seq_id=5, token_ids=[1, 2, 3], parents=[-1, 0, 0])
    resync = Proposal(seq_id=6, token_ids=[], resync=True)
    out = drafter_pb2.ProposalBatch()
    for p in (chain, tree, resync):
        proposal_to_proto(out, p.seq_id, p)
    got = drafter_pb2.ProposalBatch.FromString(out.SerializeToString()).proposals
    trusted = [proposal_from_proto(p, "dm", use_q=True) for p in got]
    for p, back in zip((chain, tree, resync), trusted):
        assert (back.seq_id, back.token_ids, back.parents, back.resync, back.history_held, back.cached) == (
            p.seq_id, p.token_ids, p.parents, p.resync, p.history_held, p.cached)
        assert back.drafter == "dm"
    assert trusted[0].q_ids == chain.q_ids and trusted[0].q_probs == chain.q_probs
    assert proposal_from_proto(got[0], "dm", use_q=False).q_ids is None  # an untrusted drafter's q is not read
