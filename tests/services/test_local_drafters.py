"""An index drafter inside the verifier process (--local-drafter) beside a drafter service: it
serves like any drafter of the pool (a request may name it, greedy output never changes, it is
listed and exported), and the pool keeps its name: no service registers under it, and it cannot
be removed at runtime. Real processes on loopback, the official client through the gateway."""
from __future__ import annotations

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
# The same prompts and offline greedy reference as the service drafters' tests (module fixtures).
from test_verifier_drafters import TARGET_DIR, _drafters, _wait, generate_all, prompts, reference, tokenizer  # noqa: F401

from specd.v1 import verifier_pb2 as pb
from specd.v1 import verifier_pb2_grpc as pbg


@pytest.fixture(scope="module")
def stack(launcher):
    ng = launcher.start("drafter-ng", "drafter", ["--method", "ngram", "--name", "ng"])
    metrics_port = launcher.free_port()
    verifier = launcher.start("verifier", "verifier", ["--model", TARGET_DIR, "--drafter", f"ng={ng.address}",
                                                       "--local-drafter", "suffix", "--metrics-port", str(metrics_port)])
    gateway = launcher.start("gateway", "gateway", ["--verifier", verifier.address], http=True)
    stub = pbg.VerifierStub(grpc.insecure_channel(verifier.address))
    _wait(lambda: len(_drafters(stub)) == 2 and all(d.healthy for d in _drafters(stub).values()))
    client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="x", max_retries=0, timeout=120)
    return dict(ng=ng, stub=stub, client=client, metrics_port=metrics_port)


def test_a_local_drafter_serves_beside_a_service(stack, prompts, reference):
    listed = _drafters(stack["stub"])
    assert listed["suffix"].address == "in-process" and listed["suffix"].method == "suffix"
    assert listed["ng"].address == stack["ng"].address
    for kw in ({}, {"drafter": "suffix", "k": 4}, {"drafter": "ng", "k": 4}, {"k": 0}):
        results = generate_all(stack["client"], prompts, **kw)
        assert [text for text, _, _ in results] == reference, kw
        drafted = set().union(*(spec["drafters"] for _, _, spec in results))
        if "drafter" in kw:
            assert drafted == {kw["drafter"]}, kw  # a request that named its drafter keeps it
            assert sum(spec["draft_tokens"] for _, _, spec in results) > 0, kw
        else:
            assert drafted <= {"suffix", "ng"}
    # Its counters reach ListDrafters and Prometheus like a service's.
    assert _drafters(stack["stub"])["suffix"].draft_tokens > 0
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{stack['metrics_port']}/metrics", timeout=10) as reply:
        families = {f.name: f for f in text_string_to_metric_families(reply.read().decode())}
    healthy = {s.labels["drafter"]: s.value for s in families["specd_verifier_drafter_healthy"].samples}
    assert healthy == {"suffix": 1.0, "ng": 1.0}


def test_the_pool_keeps_a_local_drafters_name(stack, prompts, reference):
    stub = stack["stub"]
    with pytest.raises(grpc.RpcError) as e:
        stub.RemoveDrafter(pb.RemoveDrafterRequest(name="suffix"), timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "inside the verifier" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stub.RegisterDrafter(pb.RegisterDrafterRequest(name="suffix", address=stack["ng"].address), timeout=30)
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "inside this verifier" in e.value.details()
    assert set(_drafters(stub)) == {"suffix", "ng"}
    results = generate_all(stack["client"], prompts[:4], drafter="suffix", k=4)  # still serving
    assert [text for text, _, _ in results] == reference[:4]
