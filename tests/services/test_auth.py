"""Authentication on every hop (issue 14): an auth matrix over every gRPC method and HTTP endpoint
(no credential, a wrong one, the right one), the drafter address allowlist, and TLS for gRPC
and HTTP with a self-signed certificate this test makes. Real processes on loopback."""
from __future__ import annotations

import ssl
import subprocess
import time

import grpc
import httpx
import openai
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tls_certs import make_self_signed

from specd.rpc import auth
from specd.models.demo_paths import demo_model_dir
from specd.cli.readiness import grpc_serving
from specd.v1 import drafter_pb2 as dpb
from specd.v1 import drafter_pb2_grpc as dpbg
from specd.v1 import verifier_pb2 as pb
from specd.v1 import verifier_pb2_grpc as pbg

SECRET = "auth-matrix-secret"
API_KEY, ADMIN_KEY = "sk-api", "sk-admin"
TARGET = str(demo_model_dir("target"))
DENIED = grpc.StatusCode.UNAUTHENTICATED

# (label, metadata) per credential; "right" is filled in per audience.
WRONG = {
    "none": None,
    "other secret": [("authorization", f"Bearer {auth.token('not-the-secret', auth.VERIFIER)}")],
    "raw secret": [("authorization", f"Bearer {SECRET}")],
    "not bearer": [("authorization", auth.token(SECRET, auth.VERIFIER))],
}


def bearer(audience: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {auth.token(SECRET, audience)}")]


@pytest.fixture(scope="module")
def stack(launcher):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(auth.TOKEN_ENV, SECRET)
        drafter = launcher.start("drafter", "drafter", ["--method", "ngram", "--name", "ng"])
        verifier = launcher.start("verifier", "verifier", ["--model", TARGET, "--drafter", f"ng={drafter.address}"])
        gateway = launcher.start("gateway", "gateway", ["--verifier", verifier.address, "--api-key", API_KEY,
                                                        "--admin-key", ADMIN_KEY], http=True)
    return dict(drafter=drafter, verifier=verifier, gateway=gateway)


def _verifier_calls(stub, drafter_address: str):
    """Every Verifier RPC, each a function of the call metadata."""
    params = pb.SamplingParams(max_tokens=2, temperature=0)
    return {
        "Generate": lambda md: list(stub.Generate(pb.GenerateRequest(prompt_token_ids=[5, 6], params=params),
                                                  metadata=md, timeout=60)),
        "Abort": lambda md: stub.Abort(pb.AbortRequest(request_id="nope"), metadata=md, timeout=30),
        "Info": lambda md: stub.Info(pb.InfoRequest(), metadata=md, timeout=30),
        "ListDrafters": lambda md: stub.ListDrafters(pb.ListDraftersRequest(), metadata=md, timeout=30),
        "RegisterDrafter": lambda md: stub.RegisterDrafter(
            pb.RegisterDrafterRequest(name="ng", address=drafter_address), metadata=md, timeout=30),
        "RemoveDrafter": lambda md: stub.RemoveDrafter(pb.RemoveDrafterRequest(name="absent"), metadata=md, timeout=30),
    }


def _code(call, md) -> grpc.StatusCode:
    try:
        call(md)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_grpc_auth_matrix(stack):
    channel = grpc.insecure_channel(stack["verifier"].address)
    calls = _verifier_calls(pbg.VerifierStub(channel), stack["drafter"].address)
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    calls["reflection"] = lambda md: list(reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), metadata=md, timeout=30))
    drafter = dpbg.DrafterStub(grpc.insecure_channel(stack["drafter"].address))
    drafter_calls = {
        "Drafter.Info": lambda md: drafter.Info(dpb.DrafterInfoRequest(), metadata=md, timeout=30),
        "Drafter.Release": lambda md: drafter.Release(dpb.ReleaseRequest(client_id="x", seq_ids=[1]),
                                                      metadata=md, timeout=30),
        "Drafter.Propose": lambda md: list(drafter.Propose(iter([dpb.ProposeBatch(client_id="x", batch_id=1)]),
                                                            metadata=md, timeout=30)),
    }
    # Expected outcome with the right token: past authentication, whatever the method then says.
    right = {"Generate": grpc.StatusCode.OK, "Abort": grpc.StatusCode.OK, "Info": grpc.StatusCode.OK,
             "ListDrafters": grpc.StatusCode.OK, "RegisterDrafter": grpc.StatusCode.ALREADY_EXISTS,
             "RemoveDrafter": grpc.StatusCode.NOT_FOUND, "reflection": grpc.StatusCode.OK,
             "Drafter.Info": grpc.StatusCode.OK, "Drafter.Release": grpc.StatusCode.OK,
             "Drafter.Propose": grpc.StatusCode.OK}
    table = {}
    for audience, group in ((auth.VERIFIER, calls), (auth.DRAFTER, drafter_calls)):
        other = auth.DRAFTER if audience == auth.VERIFIER else auth.VERIFIER
        for name, call in group.items():
            for label, md in [*WRONG.items(), (f"{other} token", bearer(other))]:
                table[(name, label)] = _code(call, md)
                assert table[(name, label)] == DENIED, (name, label, table[(name, label)])
            table[(name, "right")] = _code(call, bearer(audience))
            assert table[(name, "right")] == right[name], (name, table[(name, "right")])
    # Health stays open (probes), on both services.
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    for address in (stack["verifier"].address, stack["drafter"].address):
        reply = health_pb2_grpc.HealthStub(grpc.insecure_channel(address)).Check(health_pb2.HealthCheckRequest(),
                                                                                timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


HTTP = [  # (method, path, json body, which key opens it)
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, "api"),
    ("POST", "/v1/completions", {"prompt": "def f", "max_tokens": 2}, "api"),
    ("GET", "/v1/models", None, "api"),
    ("GET", "/admin/drafters", None, "admin"),
    ("POST", "/admin/drafters", {"name": "ng", "address": "127.0.0.1:1"}, "admin"),
    ("DELETE", "/admin/drafters/absent", None, "admin"),
    ("GET", "/health", None, None),
    ("GET", "/metrics", None, None),
]


def test_http_auth_matrix(stack):
    base = f"http://{stack['gateway'].address}"
    keys = {"api": API_KEY, "admin": ADMIN_KEY}
    right_status = {"/v1/chat/completions": 200, "/v1/completions": 200, "/v1/models": 200,
                    ("GET", "/admin/drafters"): 200, ("POST", "/admin/drafters"): 409,  # "ng" exists
                    "/admin/drafters/absent": 404, "/health": 200, "/metrics": 200}
    for method, path, body, opens in HTTP:
        expected = right_status.get((method, path), right_status.get(path))
        wrong = {"none": {}, "wrong": {"Authorization": "Bearer nope"}, "no bearer": {"Authorization": API_KEY}}
        if opens is not None:  # the other key does not open it either
            wrong["other key"] = {"Authorization": f"Bearer {keys['admin' if opens == 'api' else 'api']}"}
        for label, headers in wrong.items():
            r = httpx.request(method, base + path, json=body, headers=headers, timeout=60)
            if opens is None:
                assert r.status_code == expected, (method, path, label, r.text)
            else:
                assert r.status_code == 401, (method, path, label, r.status_code, r.text)
                assert r.json()["error"]["type"] == "authentication_error"
        if opens is not None:
            r = httpx.request(method, base + path, json=body, headers={"Authorization": f"Bearer {keys[opens]}"},
                              timeout=60)
            assert r.status_code == expected, (method, path, r.text)


def test_register_only_to_allowed_addresses(stack):
    stub = pbg.VerifierStub(auth.sync_channel(stack["verifier"].address, auth.Security(secret=SECRET),
                                              auth.VERIFIER))
    for address in ("10.1.2.3:50061", "example.com:443", "169.254.169.254:80"):
        with pytest.raises(grpc.RpcError) as e:
            stub.RegisterDrafter(pb.RegisterDrafterRequest(name="x", address=address), timeout=30)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "--allow-drafter-address" in e.value.details()
    # Trust is refused to a drafter that cannot prove the secret: it is untrusted by default and
    # this one (started with the secret) can, so register a second name for it trusted.
    reply = stub.RegisterDrafter(pb.RegisterDrafterRequest(name="ng-trusted", address=stack["drafter"].address,
                                                           trusted=True), timeout=30)
    assert reply.drafter.trusted and reply.drafter.healthy
    stub.RemoveDrafter(pb.RemoveDrafterRequest(name="ng-trusted"), timeout=30)


def test_gateway_without_the_secret_refuses_to_start(stack, specd_cli, cli_env):
    env = {k: v for k, v in cli_env.items() if k != auth.TOKEN_ENV}
    r = subprocess.run([*specd_cli, "gateway", "--verifier", stack["verifier"].address, "--port", "0",
                        "--verifier-wait", "20"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "refused our credentials" in r.stderr, r.stderr


def test_trust_without_a_secret_is_refused(specd_cli, cli_env):
    env = {k: v for k, v in cli_env.items() if k != auth.TOKEN_ENV}
    r = subprocess.run([*specd_cli, "verifier", "--model", TARGET, "--trusted-drafter", "d=127.0.0.1:1"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "--trusted-drafter needs authentication" in r.stderr, r.stderr


# ---------------------------------------------------------------- TLS


def _wait(cond, service, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if service.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{service.name} did not come up:\n{service.log_text()[-3000:]}")
        time.sleep(0.3)


def test_tls_on_every_hop(launcher, tmp_path):
    cert, key = make_self_signed(tmp_path)
    tls = auth.Security(secret=SECRET, tls_ca=cert)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(auth.TOKEN_ENV, SECRET)
        drafter = launcher.start("tls-drafter", "drafter", ["--method", "ngram", "--name", "ng", "--tls-cert", cert,
                                                            "--tls-key", key], wait=False)
        _wait(lambda: grpc_serving(drafter.address, tls), drafter)
        verifier = launcher.start("tls-verifier", "verifier", [
            "--model", TARGET, "--tls-cert", cert, "--tls-key", key, "--tls-ca", cert,
            "--drafter", f"ng=localhost:{drafter.address.rsplit(':', 1)[1]}"], wait=False)
        _wait(lambda: grpc_serving(verifier.address, tls), verifier)
        gateway = launcher.start("tls-gateway", "gateway", [
            "--verifier", f"localhost:{verifier.address.rsplit(':', 1)[1]}", "--tls-ca", cert,
            "--ssl-certfile", cert, "--ssl-keyfile", key], wait=False)
    base = f"https://localhost:{gateway.address.rsplit(':', 1)[1]}"
    trust = ssl.create_default_context(cafile=cert)

    def https_ok():
        try:
            return httpx.get(f"{base}/health", verify=trust, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    _wait(https_ok, gateway)
    stub = pbg.VerifierStub(auth.sync_channel(verifier.address, tls, auth.VERIFIER))
    deadline = time.monotonic() + 60
    while not any(d.healthy for d in stub.ListDrafters(pb.ListDraftersRequest(), timeout=10).drafters):
        assert time.monotonic() < deadline, "the verifier never reached its drafter over TLS"
        time.sleep(0.2)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60,
                           http_client=httpx.Client(verify=trust))
    # The drafter's first history goes in the background (no step waits for it), so a short request
    # may finish before its first draft where the machine is busy: up to three requests, each answered.
    drafts = 0
    for _ in range(3):
        out = client.completions.create(model="specd-demo-target", prompt="x = 1\nx = 1\nx = 1\nx = 1\nx = 1\nx",
                                        max_tokens=24, temperature=0, extra_body={"speculative": {
                                            "num_speculative_tokens": 4, "drafter": "ng"}})
        assert out.usage.completion_tokens == 24
        drafts = out.usage.model_extra["speculative"]["drafts"]
        if drafts:
            break
    assert drafts > 0, "no draft came back over TLS"
    # Plaintext is refused on every hop: HTTP, and gRPC without TLS (even with the right token).
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://localhost:{gateway.address.rsplit(':', 1)[1]}/health", timeout=5)
    plain = pbg.VerifierStub(auth.sync_channel(verifier.address, auth.Security(secret=SECRET), auth.VERIFIER))
    with pytest.raises(grpc.RpcError) as e:
        plain.Info(pb.InfoRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "Traceback" not in verifier.log_text() + drafter.log_text()
