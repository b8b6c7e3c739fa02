"""Hidden states over the wire (issue 15's contract).

The verifier's drafter pool ships the target's features to a hidden-state drafter hosted by
the real DrafterService on loopback gRPC: the rows the drafter receives must equal
transformers' hidden states, a long history's features arrive in k = 0 pieces under the
message bound, a drafter built for another target is refused at registration, and malformed
features cost the sender its drafts, not the drafter its health.
"""
from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from feature_recorder import FeatureRecorder, hf_features

from specd.config import EngineConfig, SpeculativeConfig
from specd.drafter.main import describe_features
from specd.drafter.server import DrafterService
from specd.engine.llm_engine import LLMEngine
from specd.proposers.base import ProposeRequest, feature_rows
from specd.sampling import SamplingParams
from specd.v1 import drafter_pb2, drafter_pb2_grpc
from specd.verifier import drafter_pool, propose_bounds
from specd.verifier.drafter_client import FeatureMismatch, FeatureTarget, check_features
from specd.verifier.drafter_pool import DrafterPool
from specd.verifier.pool_proposer import PoolProposer
from specd.verifier.propose_bounds import wire_pieces
from specd.rpc.wire import tensor_to_proto

transformers = pytest.importorskip("transformers")


def run(loop, coro, timeout=30):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


async def serve(proposer, info) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    drafter_pb2_grpc.add_DrafterServicer_to_server(DrafterService(proposer, info), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def drafter_info(proposer, name: str, vocab: int) -> drafter_pb2.DrafterInfoResponse:
    info = drafter_pb2.DrafterInfoResponse(name=name, method="eagle", vocab_size=vocab, max_k=8)
    describe_features(proposer, info)
    return info


def test_the_drafter_receives_the_targets_hidden_states_in_pieces(loop, model_dirs, hf_greedy, make_prompts,
                                                                   monkeypatch):
    target = model_dirs["llama3"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    cfg = hf.config
    L, H, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    layers = (L,)  # what EAGLE, Medusa and MLP speculators read
    # At most 16 rows per message: the 45-token prompt's features travel in three pieces.
    monkeypatch.setattr(drafter_pool, "MAX_FEATURE_BYTES", 16 * len(layers) * H * 4)
    prompts = make_prompts(2, seed=3, lengths=[45, 12])
    new_tokens = 16
    references = [list(p) + hf_greedy(target, p, new_tokens, ignore_eos=True) for p in prompts]
    recorder = FeatureRecorder(layers, references, V, hidden_size=H, target_layers=L)
    wrong = FeatureRecorder(layers, references, V, hidden_size=H + 8, target_layers=L)
    good_server, good = run(loop, serve(recorder, drafter_info(recorder, "eagle", V)))
    bad_server, bad = run(loop, serve(wrong, drafter_info(wrong, "other-target", V)))
    pool = DrafterPool(V, "", timeout_s=10.0)
    engine = LLMEngine(EngineConfig(model=target, dtype="float32", seed=0),
                       SpeculativeConfig(num_speculative_tokens=3, adaptive=False), proposer=PoolProposer(pool, loop))
    pool.target = FeatureTarget(H, L, engine.model.fingerprint)
    with pytest.raises(FeatureMismatch, match="hidden size"):
        run(loop, pool.register("other-target", bad))
    run(loop, pool.register("eagle", good))
    assert pool.feature_layers == layers

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, seq_id=i)
    outputs = {}
    while engine.has_unfinished():
        for seq in engine.step():
            outputs[seq.seq_id] = seq.output_token_ids
    run(loop, pool.close())
    for server in (good_server, bad_server):
        run(loop, server.stop(None))

    assert [outputs[i] for i in range(len(prompts))] == [r[len(p):] for r, p in zip(references, prompts)]
    assert all(rows == wanted for _, _, rows, wanted, _ in recorder.requests)
    pieces = [r for r in recorder.requests if r[4] == 0]  # the long prompt's leading pieces
    assert len(pieces) >= 2 and pieces[0][0]
    assert all(rows <= 16 for _, _, rows, _, _ in recorder.requests)  # none over the message bound
    assert sum(full for full, *_ in recorder.requests) == len(prompts)  # one full history each
    assert sum(r[4] > 0 for r in recorder.requests) > len(prompts)  # and drafting steps after it
    for i, seen in recorder.rows.items():
        expected = hf_features(hf, references[i], layers)
        assert len(seen) >= len(prompts[i]) + new_tokens // 2
        for pos, row in seen.items():
            torch.testing.assert_close(row, expected[pos], rtol=1e-4, atol=1e-4)


def test_wire_pieces_cut_tokens_and_rows_at_the_same_place(monkeypatch):
    monkeypatch.setattr(propose_bounds, "MAX_FEATURE_BYTES", 4 * 2 * 3 * 4)  # 4 rows of 2 layers x 3 wide, fp32
    n = 11
    feats = torch.arange((n - 1) * 3 * 3, dtype=torch.float32).view(n - 1, 9)  # layers (0, 2, 5), H = 3
    req = ProposeRequest(seq_id=7, new_tokens=list(range(100, 100 + n)), num_tokens=n, k=4, full_history=True,
                         features=feats, feature_layers=(0, 2, 5))
    pieces = wire_pieces(req, (5, 0))  # a drafter wanting layers 5 and 0, in that order
    assert [p.full_history for p in pieces] == [True, False, False]
    assert sum((p.new_tokens for p in pieces), []) == req.new_tokens
    assert [p.num_tokens for p in pieces] == [5, 9, 11]
    assert all(p.features.shape[0] == feature_rows(p) for p in pieces)
    got = torch.cat([p.features for p in pieces])
    assert torch.equal(got, torch.cat([feats[:, 6:9], feats[:, 0:3]], dim=1))
    assert pieces[-1].k == 4 and all(p.feature_layers == (5, 0) for p in pieces)
    # A token-only drafter gets no features at all.
    assert wire_pieces(req, ())[0].features is None
    # Rows from pair 3 on (the head holds pairs 0..2): the first piece is still the whole token
    # history up to where its rows end, with features_from; the deltas after it carry none.
    late = ProposeRequest(seq_id=7, new_tokens=list(range(100, 100 + n)), num_tokens=n, k=4, full_history=True,
                          features=feats[3:], feature_layers=(0, 2, 5), features_from=3)
    pieces = wire_pieces(late, (5, 0))
    assert [p.num_tokens for p in pieces] == [8, 11] and [p.features_from for p in pieces] == [3, 0]
    assert pieces[0].new_tokens == late.new_tokens[:8] and sum((p.new_tokens for p in pieces), []) == late.new_tokens
    assert all(p.features.shape[0] == feature_rows(p) for p in pieces)
    assert torch.equal(torch.cat([p.features for p in pieces]), torch.cat([feats[3:, 6:9], feats[3:, 0:3]], dim=1))


def test_check_features_refuses_another_target():
    target = FeatureTarget(hidden_size=64, num_layers=4, fingerprint="abc")
    ok = dict(name="d", feature_layers=[4], hidden_size=64, target_layers=4)
    check_features(drafter_pb2.DrafterInfoResponse(**ok), target)
    check_features(drafter_pb2.DrafterInfoResponse(**ok, target_fingerprint="abc"), target)
    check_features(drafter_pb2.DrafterInfoResponse(name="ngram"), None)  # token-only: nothing to check
    for bad, match in ((dict(ok, hidden_size=32), "hidden size"), (dict(ok, target_layers=5), "layers"),
                       (dict(ok, feature_layers=[5]), "asks for hidden states"),
                       (dict(ok, target_fingerprint="xyz"), "other target weights")):
        with pytest.raises(FeatureMismatch, match=match):
            check_features(drafter_pb2.DrafterInfoResponse(**bad), target)
    with pytest.raises(FeatureMismatch, match="does not send"):
        check_features(drafter_pb2.DrafterInfoResponse(**ok), None)


def test_malformed_features_cost_drafts_not_the_drafter():
    recorder = FeatureRecorder((4,), [list(range(10, 40))], 512, hidden_size=8, target_layers=4)
    service = DrafterService(recorder, drafter_info(recorder, "eagle", 512))
    batch = drafter_pb2.ProposeBatch(client_id="v")
    good = batch.entries.add(seq_id=1, new_tokens=list(range(10, 20)), num_tokens=10, k=2, full_history=True)
    tensor_to_proto(torch.zeros(9, 8), good.features)
    short = batch.entries.add(seq_id=2, new_tokens=list(range(10, 20)), num_tokens=10, k=2, full_history=True)
    tensor_to_proto(torch.zeros(8, 8), short.features)  # one row too few
    lying = batch.entries.add(seq_id=3, new_tokens=list(range(10, 20)), num_tokens=10, k=2, full_history=True)
    tensor_to_proto(torch.zeros(9, 8), lying.features)
    lying.features.shape[:] = [9, 800]  # bytes for 9 x 8, shape says more
    batch.entries.add(seq_id=4, new_tokens=list(range(10, 20)), num_tokens=10, k=2, full_history=True)  # none
    requests, answered, unknown = service._requests(batch, [])
    assert answered == [0] and not unknown
    assert requests[0].features.shape == (9, 8)
