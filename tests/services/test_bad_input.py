"""Client input never causes a 500, and never costs the connection: the inputs a probe of the
stack found (values that overflow the gRPC message, lone surrogates, deeply nested JSON, an
over-long integer) sent to a real gateway process over one keep-alive HTTP/1.1 connection,
each followed by a good request on the same socket. Also: the verifier's gRPC contract for
unset fields, and cancelled streams that leave quiet logs."""
from __future__ import annotations

import http.client
import json
import time

import grpc
import httpx
import pytest

from specd.models.demo_paths import demo_model_dir
from specd.v1 import verifier_pb2 as pb
from specd.v1 import verifier_pb2_grpc as pbg

MODEL_DIR = demo_model_dir("target")
NESTED = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"

BAD = [  # (path, raw body, param, message fragment)
    ("/v1/completions", {"prompt": "x", "top_k": 2 ** 31}, "top_k", "top_k"),
    ("/v1/completions", {"prompt": "x", "top_k": 2 ** 63}, "top_k", "top_k"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop_token_ids": [2 ** 32]},
     "stop_token_ids", "stop_token_ids"),
    ("/v1/completions", b'{"prompt": "a \\ud800 b", "max_tokens": 2}', "prompt", "surrogate"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages", "surrogate"),
    ("/v1/completions", NESTED, None, "nests deeper"),
    ("/v1/chat/completions", b'{"messages": ' + b"[" * 500 + b"]" * 500 + b"}", "messages", "nests deeper"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", None, "not valid JSON"),
]


@pytest.fixture(scope="module")
def stack(launcher):
    verifier = launcher.start("verifier", "verifier", ["--model", str(MODEL_DIR), "--no-speculation"])
    gateway = launcher.start("gateway", "gateway", ["--verifier", verifier.address], http=True)
    return dict(verifier=verifier, gateway=gateway)


def _post(conn: http.client.HTTPConnection, path: str, body) -> http.client.HTTPResponse:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, body=raw, headers={"content-type": "application/json"})
    response = conn.getresponse()
    response.body = response.read()
    return response


def test_bad_input_is_a_400_and_the_connection_stays_usable(stack):
    host, port = stack["gateway"].address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    good = {"prompt": "def f", "max_tokens": 2, "temperature": 0}
    assert _post(conn, "/v1/completions", good).status == 200
    sock = conn.sock
    for path, body, param, fragment in BAD:
        r = _post(conn, path, body)
        assert r.status == 400, (path, r.status, r.body[:300])
        err = json.loads(r.body)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
        assert err["param"] == param and fragment in err["message"], err
        assert r.getheader("connection", "").lower() != "close" and not r.will_close
        ok = _post(conn, "/v1/completions", good)
        assert ok.status == 200 and conn.sock is sock, "the connection was dropped after a bad request"
    assert "Traceback" not in stack["gateway"].log_text()


def test_unset_top_p_means_the_default(stack):
    stub = pbg.VerifierStub(grpc.insecure_channel(stack["verifier"].address))
    # Only max_tokens set: temperature 0 (greedy), top_p unset = 1.0, as the proto documents.
    chunks = list(stub.Generate(pb.GenerateRequest(prompt_token_ids=[5, 6, 7], params=pb.SamplingParams(max_tokens=3)),
                                timeout=60))
    assert chunks[-1].finish_reason in ("stop", "length") and chunks[-1].completion_tokens >= 1
    with pytest.raises(grpc.RpcError) as e:  # an explicit bad top_p is still refused
        list(stub.Generate(pb.GenerateRequest(prompt_token_ids=[5], params=pb.SamplingParams(max_tokens=3, top_p=2)),
                           timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in e.value.details()


def test_cancelled_streams_leave_quiet_logs(stack):
    url = f"http://{stack['gateway'].address}/v1/completions"
    body = {"prompt": "def f", "max_tokens": 500, "ignore_eos": True, "temperature": 0, "stream": True}
    for _ in range(3):
        with httpx.stream("POST", url, json=body, timeout=30) as r:
            assert r.status_code == 200
            assert next(r.iter_lines()).startswith("data: ")
    # Direct gRPC streams cancelled by the client, too.
    stub = pbg.VerifierStub(grpc.insecure_channel(stack["verifier"].address))
    for _ in range(3):
        call = stub.Generate(pb.GenerateRequest(prompt_token_ids=[5, 6], params=pb.SamplingParams(
            max_tokens=500, ignore_eos=True)), timeout=60)
        next(call)
        call.cancel()
    time.sleep(1.0)
    assert httpx.get(f"http://{stack['gateway'].address}/health").status_code == 200
    for service in ("verifier", "gateway"):
        log = stack[service].log_text()
        assert "Traceback" not in log and "Failed to detach context" not in log, f"{service}:\n{log[-3000:]}"


def test_services_freeze_their_startup_heap_once_serving(stack):
    """The verifier (as every gRPC service: the same serve()) and the gateway freeze what startup left
    alive out of garbage collection: a full pass that walked a loaded model's objects took 140 ms,
    on whichever decode step it fell."""
    for service in ("verifier", "gateway"):
        frozen = [line for line in stack[service].log_text().splitlines()
                  if "startup objects frozen out of garbage collection" in line]
        assert len(frozen) == 1, f"{service}:\n{stack[service].log_text()[-3000:]}"
        assert int(frozen[0].rsplit(": ", 1)[1].split()[0]) > 10_000  # the objects a service starts with
