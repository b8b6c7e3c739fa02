"""State that survives a verifier restart (issue 14): drafters registered at runtime come back
(--drafter-registry), and a request that had produced no token when the verifier was lost is
sent again once it is back, so the client sees a normal answer. Real processes on loopback."""
from __future__ import annotations

import json
import signal
import threading
import time

import grpc
import httpx
import pytest

from specd.models.demo_paths import demo_model_dir
from specd.v1 import verifier_pb2 as pb
from specd.v1 import verifier_pb2_grpc as pbg

TARGET = str(demo_model_dir("target"))
BODY = {"prompt": "def f", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def _drafters(address: str) -> dict:
    stub = pbg.VerifierStub(grpc.insecure_channel(address))
    return {d.name: d for d in stub.ListDrafters(pb.ListDraftersRequest(), timeout=30).drafters}


def _wait(cond, timeout=60.0, what=""):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def stack(launcher, tmp_path_factory):
    registry = tmp_path_factory.mktemp("registry") / "drafters.json"
    ng = launcher.start("drafter", "drafter", ["--method", "ngram", "--name", "ng"])
    port = launcher.free_port()
    argv = ["--model", TARGET, "--drafter-registry", str(registry)]
    verifier = launcher.start("verifier", "verifier", argv, port=port)
    gateway = launcher.start("gateway", "gateway", ["--verifier", verifier.address, "--verifier-retry", "120"],
                             http=True)
    return dict(launcher=launcher, ng=ng, verifier=verifier, argv=argv, port=port, gateway=gateway,
                registry=registry, base=f"http://{gateway.address}")


def _restart(stack, wait: bool = True):
    stack["verifier"] = stack["launcher"].start("verifier-again", "verifier", stack["argv"], port=stack["port"],
                                                wait=wait)


def test_runtime_drafters_survive_a_restart(stack):
    address = stack["verifier"].address
    stub = pbg.VerifierStub(grpc.insecure_channel(address))
    stub.RegisterDrafter(pb.RegisterDrafterRequest(name="ng-runtime", address=stack["ng"].address), timeout=30)
    assert json.loads(stack["registry"].read_text()) == [{"name": "ng-runtime", "address": stack["ng"].address,
                                                          "trusted": False}]
    stack["verifier"].proc.send_signal(signal.SIGKILL)  # a crash: nothing gets to write anything
    stack["verifier"].proc.wait()
    _restart(stack)
    _wait(lambda: "ng-runtime" in _drafters(address) and _drafters(address)["ng-runtime"].healthy,
          what="the runtime drafter back and healthy")
    r = httpx.post(f"{stack['base']}/v1/completions", json={**BODY, "speculative": {
        "drafter": "ng-runtime", "num_speculative_tokens": 2}}, timeout=120)
    assert r.status_code == 200, r.text
    # Removing it forgets it for good.
    stub.RemoveDrafter(pb.RemoveDrafterRequest(name="ng-runtime"), timeout=30)
    assert json.loads(stack["registry"].read_text()) == []


def test_a_request_lost_before_its_first_token_is_sent_again(stack):
    reference = httpx.post(f"{stack['base']}/v1/completions", json=BODY, timeout=120).json()["choices"][0]["text"]
    stack["verifier"].proc.send_signal(signal.SIGKILL)
    stack["verifier"].proc.wait()
    result = {}
    client = threading.Thread(target=lambda: result.update(
        r=httpx.post(f"{stack['base']}/v1/completions", json=BODY, timeout=300)))
    client.start()
    time.sleep(1.0)  # the request meets a dead verifier, then waits for it
    assert client.is_alive()
    _restart(stack)
    client.join(300)
    r = result["r"]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == reference
    assert "trying again" in stack["gateway"].log_text()
