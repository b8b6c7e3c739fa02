"""compose.yaml + compose.secure.yaml on real containers (`docker`-marked, like test_compose.py;
`pytest -m docker tests/compose`): secrets from deploy/make-secrets.sh given as Compose file
secrets, the shared secret and TLS on every gRPC hop, HTTPS at the gateway, drafters
registered trusted, and a `specd drafters swap` whose new container keeps the trust.
Checked from the host through the published ports: a chat completion over HTTPS whose
drafts crossed the verifier -> drafter hop; Prometheus scraping the gateway over HTTPS; the
verifier refusing calls without the token (or without TLS); the swap."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import httpx
import pytest
from compose_stack import (COMPOSE_FILE, MODEL, SECURE_FILE, complete, make_secrets, openai_client, report,
                           start_stack, wait)

from specd.rpc import auth
from specd.v1 import verifier_pb2 as pb
from specd.v1 import verifier_pb2_grpc as pbg

PROFILES = ["--profile", "ngram"]
REPEATS = "x = 1\nx = 1\nx = 1\nx = 1\nx = 1\nx"  # the ngram drafter drafts on it from the first step


@pytest.fixture(scope="module")
def secure_stack(request, tmp_path_factory):
    secrets = make_secrets(tmp_path_factory.mktemp("compose-secure") / "secrets")
    security = auth.Security(secret=(secrets / "auth-token").read_text().strip(), tls_ca=str(secrets / "ca.crt"))
    yield from start_stack(request, [COMPOSE_FILE, SECURE_FILE], PROFILES, {"SPECD_SECRETS_DIR": str(secrets)},
                           security)


def drafters_cli(stack, *args) -> subprocess.CompletedProcess:
    secrets = Path(stack.env["SPECD_SECRETS_DIR"])
    return subprocess.run([sys.executable, "-m", "specd.cli", "drafters", "--verifier", stack.verifier,
                           "--auth-token-file", str(secrets / "auth-token"), "--tls-ca", str(secrets / "ca.crt"),
                           *args], capture_output=True, text=True, timeout=600)


@pytest.mark.docker
@pytest.mark.timeout(2400)
def test_chat_completion_over_tls_with_trusted_drafters(secure_stack):
    drafters = secure_stack.drafters()
    assert drafters["dm"].trusted and drafters["ng"].trusted  # each proved it holds the secret
    client = openai_client(secure_stack)
    t0 = time.monotonic()
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "def fibonacci(n):"}],
                                           max_tokens=24, temperature=0)
    report(f"chat completion over HTTPS in {time.monotonic() - t0:.2f} s: {reply.choices[0].message.content[:60]!r}")
    assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
    # Drafts that crossed the verifier -> drafter hop (TLS, token, trust proof).
    text, spec = complete(client, REPEATS, drafter="ng", num_speculative_tokens=4)
    report(f"completion via drafter ng: {spec}")
    assert text and spec["draft_tokens"] > 0
    # The gateway speaks HTTPS only.
    with pytest.raises(httpx.HTTPError):
        httpx.get(secure_stack.gateway.replace("https://", "http://") + "/health", timeout=5)

    def gateway_scraped():
        targets = json.load(urllib.request.urlopen(f"{secure_stack.prometheus}/api/v1/targets", timeout=5))
        return [t for t in targets["data"]["activeTargets"]
                if t["labels"]["job"] == "gateway" and t["health"] == "up" and t["scrapeUrl"].startswith("https://")]

    wait(gateway_scraped, 90, "Prometheus scraping the gateway over HTTPS")


@pytest.mark.docker
def test_verifier_refuses_calls_without_the_token(secure_stack):
    ca = secure_stack.security.tls_ca
    credentials = {"no token": auth.Security(tls_ca=ca), "another secret": auth.Security(secret="guess", tls_ca=ca)}
    for label, security in credentials.items():
        with auth.sync_channel(secure_stack.verifier, security, auth.VERIFIER) as channel:
            stub = pbg.VerifierStub(channel)
            for name, call in (("ListDrafters", lambda: stub.ListDrafters(pb.ListDraftersRequest(), timeout=10)),
                               ("RegisterDrafter", lambda: stub.RegisterDrafter(pb.RegisterDrafterRequest(
                                   name="rogue", address="drafter-ngram:50061"), timeout=10)),
                               ("Info", lambda: stub.Info(pb.InfoRequest(), timeout=10))):
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, (label, name)
    # The right token without TLS does not get through either.
    with auth.sync_channel(secure_stack.verifier, auth.Security(secret=secure_stack.security.secret),
                           auth.VERIFIER) as channel:
        with pytest.raises(grpc.RpcError) as e:
            pbg.VerifierStub(channel).ListDrafters(pb.ListDraftersRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "rogue" not in secure_stack.drafters()


@pytest.mark.docker
@pytest.mark.timeout(1200)
def test_swap_keeps_trust(secure_stack):
    t0 = time.monotonic()
    out = drafters_cli(secure_stack, "swap", "--old", "dm", "--image", "specd-drafter")
    report(f"swap (exit {out.returncode}) in {time.monotonic() - t0:.1f} s:\n{out.stdout.rstrip()}\n{out.stderr.rstrip()}")
    assert out.returncode == 0, out.stderr
    assert "(trusted)" in out.stdout
    drafters = secure_stack.drafters()
    assert "dm" not in drafters and drafters["dm-2"].healthy
    assert drafters["dm-2"].trusted  # it proved, in the verifier's challenge, that it holds the secret
    new = secure_stack.container("drafter-dm")
    assert new.name.endswith("drafter-dm-2")
    mounts = {m["Destination"]: m for m in new.attrs["Mounts"]}
    assert {f"/run/secrets/specd-{n}" for n in ("auth-token", "tls-cert", "tls-key", "tls-ca")} <= set(mounts)
    assert not any(m["RW"] for m in mounts.values())
    # Docker runs the copied healthcheck (over TLS) on the new container too.
    wait(lambda: (new.reload() or new.attrs["State"].get("Health") or {}).get("Status") == "healthy", 120,
         "the new drafter container's healthcheck")
    text, spec = complete(openai_client(secure_stack), REPEATS, drafter="dm-2", num_speculative_tokens=4)
    report(f"completion via drafter dm-2: {spec}; dm-2: {secure_stack.drafters()['dm-2']}")
    assert text and spec["draft_tokens"] > 0
    listed = drafters_cli(secure_stack, "list", "--json")
    assert listed.returncode == 0 and {json.loads(line)["name"]: json.loads(line)["trusted"]
                                       for line in listed.stdout.splitlines()}["dm-2"] is True
