"""compose.yaml scaled out: `up --scale verifier=N` (v1 and v2), the gateway and Prometheus finding
every replica by DNS, each replica registering the drafters itself.

Cheap checks (the normal suite): the verifier service can be scaled (no container_name, no fixed
host port), the gateway's --verifier is `dns:verifier:50051` in compose.yaml and
compose.secure.yaml, every replica lists drafter-dm and drafter-ngram on its own command line,
Prometheus discovers the verifier by DNS (type A), and deploy/make-secrets.sh's certificate
names `verifier` (the name the gateway checks on every discovered replica).

The `docker`-marked test (`pytest -m docker tests/compose -k scale`): the stack with
`up -d --scale verifier=3`, then `--profile ngram up -d --scale verifier=3` (the README's order:
the replicas stay, each registers ng once it answers); dm and ng registered at each replica
(through each one's own published loopback port); streamed chat completions through the `openai` client
spread over the 3 replicas (the gateway's X-Specd-Replica header and
specd_gateway_replica_requests_total), every greedy output equal to the offline engine's;
Prometheus with 3 verifier targets up; then `up -d --scale verifier=2` while streams run: no
request that had not produced a token fails, and every request after it succeeds with the
reference text.
"""
from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from compose_stack import (COMPOSE_FILE, MAX_TOKENS, MODEL, ROOT, SECURE_FILE, make_secrets, offline_reference,
                           openai_client, report, start_stack, wait)

PROFILES = ["--profile", "ngram"]
REPLICAS = 3
QUESTIONS = ["def fibonacci(n):", "What is 2+2?", "Name three colours.", "Write a haiku about rain.",
             "import os\nimport sys", "What is the capital of France?", "Say hello in Spanish.",
             "class Parser:", "Count to five."]


def services(path: Path) -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load(path.read_text())["services"]


# ---------------------------------------------------------------- cheap checks


def test_verifier_is_scalable():
    base = services(COMPOSE_FILE)
    for name, svc in base.items():
        assert "container_name" not in svc, name  # a fixed name allows one container per service
    verifier = base["verifier"]
    assert "deploy" not in verifier and "scale" not in verifier  # the replica count is `--scale`'s
    # Host ports: none fixed, so N replicas never collide (a free loopback port each, unless
    # SPECD_VERIFIER_PORT fixes one for a single replica).
    assert verifier["ports"] == ["127.0.0.1:${SPECD_VERIFIER_PORT:-}:50051"]
    # Each replica registers both drafters itself (and retries until they answer): a replica
    # that --scale adds later, or that restarts, gets them too, with no one-shot registration.
    cmd = verifier["command"]
    drafters = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--drafter"]
    assert drafters == ["dm=drafter-dm:50061", "ng=drafter-ngram:50061"]
    assert not [n for n in base if "register" in n]
    for path in (COMPOSE_FILE, SECURE_FILE):
        gw = services(path)["gateway"]["command"]
        assert gw[gw.index("--verifier") + 1] == "dns:verifier:50051", path.name
    secure = services(SECURE_FILE)["verifier"]
    assert "ports" not in secure and "container_name" not in secure
    cmd = secure["command"]
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--trusted-drafter"] == drafters


@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus-secure.yml"])
def test_prometheus_discovers_every_verifier(config):
    yaml = pytest.importorskip("yaml")
    jobs = {j["job_name"]: j for j in yaml.safe_load((ROOT / "deploy" / config).read_text())["scrape_configs"]}
    verifier = jobs["verifier"]
    assert "static_configs" not in verifier
    assert [(d["names"], d["type"], d["port"]) for d in verifier["dns_sd_configs"]] == [(["verifier"], "A", 9401)]


def test_certificate_names_the_verifier_service(tmp_path):
    if subprocess.run(["openssl", "version"], capture_output=True).returncode != 0:
        pytest.skip("no openssl")
    d = make_secrets(tmp_path / "s")
    text = subprocess.run(["openssl", "x509", "-in", str(d / "tls.crt"), "-noout", "-text"], capture_output=True,
                          text=True, check=True).stdout
    assert "DNS:verifier," in text and "IP Address:127.0.0.1" in text


# ---------------------------------------------------------------- the scaled stack


class StreamFailed(Exception):
    def __init__(self, cause: BaseException, text: str):
        super().__init__(f"{type(cause).__name__}: {cause} (after {len(text)} characters)")
        self.text = text


def chat(client, question: str) -> tuple[str, str]:
    """One streamed greedy chat completion: (text, the X-Specd-Replica that served it)."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=MAX_TOKENS, temperature=0,
        stream=True)
    replica, text = raw.headers.get("x-specd-replica"), ""
    try:
        for chunk in raw.parse():
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
    except Exception as e:  # noqa: BLE001 — mid-stream: it had produced text
        raise StreamFailed(e, text) from e
    return text, replica


def prometheus_targets(stack, job: str) -> list[str]:
    targets = json.load(urllib.request.urlopen(f"{stack.prometheus}/api/v1/targets", timeout=5))["data"]["activeTargets"]
    return [t["health"] for t in targets if t["labels"]["job"] == job]


def replica_requests(stack) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"{stack.gateway}/metrics", timeout=5).read().decode()
    return {s.labels["replica"]: s.value for f in text_string_to_metric_families(text)
            if f.name == "specd_gateway_replica_requests" for s in f.samples if s.name.endswith("_total")}


@pytest.fixture(scope="module")
def scaled_stack(request):
    yield from start_stack(request, [COMPOSE_FILE], [], verifiers=REPLICAS)  # ngram: the test adds it


@pytest.mark.docker
@pytest.mark.timeout(2400)
def test_scaled_verifiers(scaled_stack):
    stack = scaled_stack
    verifiers = [c for c in stack.containers() if c.labels["com.docker.compose.service"] == "verifier"]
    admin = stack.verifiers()
    report(f"verifier replicas: {sorted(c.name for c in verifiers)}; admin ports {admin}")
    assert len(verifiers) == REPLICAS and len(set(admin)) == REPLICAS
    # The README's order: the ngram profile in an `up` of its own, after the stack (and with
    # --scale again). The replicas stay as they are, and each registers ng once it answers.
    t0 = time.monotonic()
    stack.run(*PROFILES, "up", "-d", "--scale", f"verifier={REPLICAS}")
    assert {c.id for c in stack.containers() if c.labels["com.docker.compose.service"] == "verifier"} == \
        {c.id for c in verifiers}
    wait(lambda: all({"dm", "ng"} <= {n for n, d in stack.drafters(v).items() if d.healthy} for v in admin), 180,
         "dm and ng registered and healthy at every replica")
    report(f"`--profile ngram up -d --scale verifier={REPLICAS}`: ng registered at every replica "
           f"{time.monotonic() - t0:.1f} s later")

    t0 = time.monotonic()
    client = openai_client(stack)
    reference = offline_reference([[{"role": "user", "content": q}] for q in QUESTIONS], client)
    report(f"offline reference: {len(QUESTIONS)} greedy chat completions in {time.monotonic() - t0:.1f} s")

    # The gateway reports a replica healthy from its first poll that finds it serving.
    wait(lambda: _gateway_sees(stack) >= REPLICAS, 120,
         f"the gateway polling {REPLICAS} healthy replicas")
    t0 = time.monotonic()
    with ThreadPoolExecutor(len(QUESTIONS)) as ex:
        results = list(ex.map(lambda q: chat(client, q), QUESTIONS))
    served = sorted({r for _, r in results})
    by_replica = replica_requests(stack)
    report(f"{len(QUESTIONS)} concurrent streams in {time.monotonic() - t0:.1f} s; X-Specd-Replica {served}; "
           f"specd_gateway_replica_requests_total {by_replica}")
    mismatches = [f"{q!r}: {t!r} != {r!r}" for q, (t, _), r in zip(QUESTIONS, results, reference) if t != r]
    assert not mismatches, "\n".join(mismatches)
    assert len(served) == REPLICAS, served  # spread over every replica
    assert len(by_replica) == REPLICAS and all(v > 0 for v in by_replica.values()), by_replica

    ups = wait(lambda: (lambda h: h if len(h) == REPLICAS and all(x == "up" for x in h) else None)(
        prometheus_targets(stack, "verifier")), 90, f"Prometheus: {REPLICAS} verifier targets up")
    report(f"Prometheus verifier targets: {ups}")

    # Scale down to 2 while streams run: compose stops one replica (SIGTERM, then SIGKILL after 10 s).
    stop = threading.Event()
    during: list[tuple[str, BaseException | str]] = []

    def load():
        i = 0
        while not stop.is_set():
            q = QUESTIONS[i % len(QUESTIONS)]
            try:
                text, _ = chat(client, q)
                during.append((q, "ok" if text == reference[QUESTIONS.index(q)] else f"text {text!r}"))
            except Exception as e:  # noqa: BLE001
                during.append((q, e))
            i += 1

    threads = [threading.Thread(target=load) for _ in range(6)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    try:
        time.sleep(3)
        stack.run(*PROFILES, "up", "-d", "--scale", f"verifier={REPLICAS - 1}")
        took = time.monotonic() - t0 - 3
        time.sleep(5)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=600)
    outcomes = {}
    for _, o in during:
        key = "ok" if o == "ok" else (f"mid-stream {o}" if isinstance(o, StreamFailed) else
                                      f"before any token: {type(o).__name__}: {o}" if isinstance(o, BaseException)
                                      else f"wrong {o}")
        outcomes[key] = outcomes.get(key, 0) + 1
    report(f"`up -d --scale verifier={REPLICAS - 1}` took {took:.1f} s; {len(during)} streams around it: {outcomes}")
    running = [c for c in stack.containers() if c.labels["com.docker.compose.service"] == "verifier"
               and c.status == "running"]
    assert len(running) == REPLICAS - 1
    # A stream cut after its first tokens may fail (its replica is gone); one that had produced
    # nothing moves to another replica; every completed one has the reference text.
    assert not [k for k in outcomes if k.startswith(("before any token", "wrong"))], outcomes

    time.sleep(3)  # the gateway resolves `verifier` every 2 s
    with ThreadPoolExecutor(len(QUESTIONS)) as ex:
        after = list(ex.map(lambda q: chat(client, q), QUESTIONS))
    served = sorted({r for _, r in after})
    report(f"after scaling to {REPLICAS - 1}: {len(QUESTIONS)} streams, X-Specd-Replica {served}")
    assert [t for t, _ in after] == reference
    assert len(served) == REPLICAS - 1, served
    ups = wait(lambda: (lambda h: h if len(h) == REPLICAS - 1 and all(x == "up" for x in h) else None)(
        prometheus_targets(stack, "verifier")), 90, f"Prometheus: {REPLICAS - 1} verifier targets up")
    report(f"Prometheus verifier targets after scaling down: {ups}")


def _gateway_sees(stack) -> int:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"{stack.gateway}/metrics", timeout=5).read().decode()
    return sum(1 for f in text_string_to_metric_families(text) if f.name == "specd_gateway_replica_healthy"
               for s in f.samples if s.value == 1)
