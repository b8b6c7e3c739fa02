"""Prefix-aware routing across verifier replicas (issue 31, point 4): a request without a session
key goes to the replica its prompt's leading 512 tokens hash to (rendezvous), so a shared system
prompt and a conversation's turns land where their KV is, unless that replica is busier than the
least loaded by more than the slack; `--routing least-loaded` ignores prefixes; every decision is
counted by reason in specd_gateway_routed_total.

Most tests drive ReplicaSet.pick with set Load values, finishing each request before the next
(as a replica's routed count moves in generation.py, so least-loaded routing takes turns and a
prefix that were ignored would spread); the last one goes through the HTTP app to in-process
verifiers, for the wiring from --routing and the prompt to pick.
"""
from __future__ import annotations

import asyncio
import random
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2
from grpc_health.v1 import health_pb2_grpc as health_grpc
from prometheus_client.parser import text_string_to_metric_families

from specd.rpc.auth import Security
from specd.models.demo_paths import demo_model_dir
from specd.gateway.metrics import GatewayMetrics
from specd.gateway.replicas import KV_FULL, PREFIX_LOAD_SLACK, VERIFIER_SERVICE, ReplicaSet, affinity_rank, prefix_key
from specd.v1 import verifier_pb2 as pb
from specd.v1 import verifier_pb2_grpc as pbg

MODEL_DIR = demo_model_dir("target")
VOCAB = 4096  # the demo tokenizer's; random prompts stay below it


@pytest.fixture(autouse=True)
def event_loop_for_channels():
    """ReplicaSet's grpc.aio channels are made on the current event loop, and a test run before
    this module may have left none set: each test gets its own."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield loop
    asyncio.set_event_loop(None)
    loop.close()


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def _replica_set(n: int, routing: str = "prefix") -> ReplicaSet:
    replicas = ReplicaSet([f"127.0.0.1:{50100 + i}" for i in range(n)], Security(), GatewayMetrics(),
                          routing=routing)
    for address in replicas.addresses:
        replicas._add(address)  # as start() does, without its poller: the tests set the loads
    return replicas


def _route(replicas: ReplicaSet, prompt: list[int], affinity: str | None = None) -> int:
    """The replica index a request goes to; it runs and ends there before the next one."""
    r = replicas.pick(affinity, prefix=prefix_key(prompt))
    r.routed += 1
    return r.index


def _ranked(replicas: ReplicaSet, prompt: list[int]) -> list[int]:
    """Replica indexes in the rendezvous order of the prompt's prefix key, first choice first."""
    key = prefix_key(prompt)
    return [r.index for r in sorted(replicas.replicas, key=lambda r: affinity_rank(key, r.address), reverse=True)]


def _routed(exposition: bytes | str) -> dict[str, float]:
    """reason -> specd_gateway_routed_total, read back from the Prometheus exposition text."""
    text = exposition.decode() if isinstance(exposition, bytes) else exposition
    return {s.labels["reason"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "specd_gateway_routed_total"}


def test_prefix_key_covers_the_first_512_tokens_of_long_prompts_only():
    rng = random.Random(0)
    system = _tokens(rng, 512)
    assert prefix_key(system[:511]) is None  # under 512 tokens: routed by load
    assert prefix_key(system) == prefix_key(system + _tokens(rng, 300))  # past 512 tokens: the same key
    assert prefix_key(system) != prefix_key(system[:511] + [system[511] ^ 1])


def test_a_shared_prefix_goes_to_one_replica_distinct_ones_spread():
    rng = random.Random(1)
    replicas = _replica_set(3)
    system = _tokens(rng, 512)
    served = {_route(replicas, system + _tokens(rng, rng.randrange(0, 200))) for _ in range(12)}
    assert served == {_ranked(replicas, system)[0]}
    distinct = [_route(replicas, _tokens(rng, 512 + rng.randrange(0, 200))) for _ in range(12)]
    assert len(set(distinct)) > 1, distinct
    assert _routed(replicas.metrics.exposition()) == {"prefix": 24}


def test_a_conversations_turns_stay_on_one_replica():
    rng = random.Random(2)
    replicas = _replica_set(3)
    firsts = []
    for _ in range(6):
        prompt = _tokens(rng, 512 + rng.randrange(0, 100))  # the first turn: system prompt and question
        turns = []
        for _ in range(5):
            turns.append(_route(replicas, prompt))
            prompt = prompt + _tokens(rng, rng.randrange(20, 80)) + _tokens(rng, rng.randrange(10, 40))
        assert len(set(turns)) == 1, turns
        firsts.append(turns[0])
    assert len(set(firsts)) > 1, firsts  # by prefix, not one replica for everything


def test_an_overloaded_prefix_replica_passes_the_request_on():
    rng = random.Random(3)
    replicas = _replica_set(3)
    prompt = _tokens(rng, 600)
    first, second, third = (replicas.replicas[i] for i in _ranked(replicas, prompt))
    first.load = pb.Load(num_requests=PREFIX_LOAD_SLACK)  # within the slack: its cached KV wins
    assert _route(replicas, prompt) == first.index
    first.load = pb.Load(num_requests=PREFIX_LOAD_SLACK + 1)
    assert _route(replicas, prompt) == second.index
    second.load = pb.Load(num_requests=2, num_waiting=3)  # waiting ones count twice: 5 pending
    assert _route(replicas, prompt) == third.index
    first.load, second.load = pb.Load(kv_blocks_used=int(KV_FULL * 100) + 1, kv_blocks_total=100), pb.Load()
    assert _route(replicas, prompt) == second.index  # idle, but its cache is nearly full
    first.load = pb.Load(num_requests=40)
    session = next(k for k in (f"session-{i}" for i in range(100))
                   if max(replicas.replicas, key=lambda r: affinity_rank(k, r.address)) is first)
    assert _route(replicas, prompt, affinity=session) == first.index  # a session stays put, however busy
    second.load = pb.Load(num_requests=1)  # the prefix's pick now, within the slack; but no key under 16 tokens:
    assert _route(replicas, prompt[:15]) == third.index  # the least loaded
    assert _routed(replicas.metrics.exposition()) == {"prefix": 1, "prefix_overloaded": 3, "session": 1,
                                                      "least_loaded": 1}


def test_least_loaded_routing_ignores_prefixes():
    rng = random.Random(4)
    replicas = _replica_set(3, routing="least-loaded")
    system = _tokens(rng, 512)
    served = [_route(replicas, system + _tokens(rng, 50)) for _ in range(9)]
    assert sorted(served) == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # turn-taking among idle replicas
    replicas.replicas[1].load = pb.Load(num_requests=1)
    assert _route(replicas, system) != 1
    assert _routed(replicas.metrics.exposition()) == {"least_loaded": 10}


class _Scripted(pbg.VerifierServicer):
    """An in-process verifier, idle and serving: four fixed tokens per request."""

    def __init__(self):
        self.calls = 0

    def Info(self, request, context):
        return pb.InfoResponse(model_name="scripted", vocab_size=VOCAB, load=pb.Load(kv_blocks_total=100))

    def Generate(self, request, context):
        self.calls += 1
        yield pb.GenerateChunk(token_ids=[65, 66, 67, 68], finish_reason="length",
                               prompt_tokens=len(request.prompt_token_ids), completion_tokens=4)


@pytest.fixture()
def verifiers():
    servers, servicers, addresses = [], [], []
    for _ in range(3):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        servicers.append(_Scripted())
        pbg.add_VerifierServicer_to_server(servicers[-1], server)
        checks = health.HealthServicer()
        checks.set(VERIFIER_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        health_grpc.add_HealthServicer_to_server(checks, server)
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        server.start()
        servers.append(server)
    yield addresses, servicers
    for server in servers:
        server.stop(grace=None)


@pytest.mark.skipif(not (MODEL_DIR / "config.json").is_file(), reason="the bundled demo target is missing")
@pytest.mark.parametrize("routing", ["prefix", "least-loaded"])
def test_the_gateway_routes_by_prefix_unless_told_otherwise(verifiers, routing):
    from starlette.testclient import TestClient

    from specd.gateway.app import build_app
    from specd.gateway.config import GatewayConfig, ModelInfo
    from specd.models.tokenizer import Tokenizer

    addresses, servicers = verifiers
    tok = Tokenizer.from_dir(MODEL_DIR)
    model = ModelInfo(name="m", path=str(MODEL_DIR), max_model_len=2048, vocab_size=tok.vocab_size)
    rng = random.Random(5)
    system = _tokens(rng, 512)
    expected = max(range(3), key=lambda i: affinity_rank(prefix_key(system), addresses[i]))
    with TestClient(build_app(GatewayConfig(verifier=addresses, routing=routing), model, tok)) as client:
        served = []
        for _ in range(6):
            r = client.post("/v1/completions", json={"model": "m", "prompt": system + _tokens(rng, 40),
                                                     "max_tokens": 4})
            assert r.status_code == 200, r.text
            served.append(int(r.headers["x-specd-replica"]))
        counts = _routed(client.get("/metrics").text)
    if routing == "prefix":
        assert served == [expected] * 6 and servicers[expected].calls == 6
        assert counts == {"prefix": 6}
    else:
        assert sorted(served) == [0, 0, 1, 1, 2, 2], served
        assert counts == {"least_loaded": 6}
