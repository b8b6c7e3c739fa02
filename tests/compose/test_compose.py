"""compose.yaml as an operator runs it, and `specd drafters swap` on real containers.

Cheap checks (no Docker engine needed) run with the rest of the suite: the shape of
compose.yaml, `docker-compose config -q` / `docker compose config -q` where a binary exists,
and the pure helpers of specd/docker_swap.py.

The `docker`-marked tests build the images, start the stack (`--profile ngram`), and check,
through the published ports: a streamed chat completion via the official `openai` client;
Prometheus scraping every service (plus each /metrics parsed from the host); the Grafana
dashboard's queries evaluating in Prometheus; a drafter container swapped while 8 streams run
(no failed request, greedy text identical to plain decoding); a swap that rolls back. They
run only when asked for (`make compose-test`, or `pytest -m docker tests/compose`): building
takes minutes. `docker compose down -v` at the end.

Environment:
  SPECD_BASE_IMAGE       base image (default specd-base:bookworm if built, else python:3.11-slim)
  SPECD_WHEELHOUSE       local wheel directories (os.pathsep-separated; default: the local
                         directories in PIP_FIND_LINKS), served over HTTP to the image builds,
                         so e.g. the host's CPU torch wheel is used where the PyTorch index is
                         unreachable
  SPECD_TORCH_INDEX_URL, SPECD_EXTRA_PIP_ARGS  passed on to compose.yaml's build arguments
"""
from __future__ import annotations

import functools
import http.server
import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from specd.docker_swap import drafter_command, next_name, split_host

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "specd.json"
MODEL = "specd-demo-target"
MAX_TOKENS = 48
PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n", "class Parser:\n    def __init__(self",
           "for i in range(10):\n    ", "    return self.", "def main():\n    args = ", "if __name__ == ",
           "with open(path) as f:\n    "]
PROFILES = ["--profile", "ngram"]
ONE_SHOT = {"drafter-ngram-register"}


def report(msg: str) -> None:
    """Progress and timings, in the test log (run with -s)."""
    print(f"[compose-test {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def compose_binaries() -> list[list[str]]:
    found = []
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        found.append(["docker", "compose"])
    if shutil.which("docker-compose"):
        found.append(["docker-compose"])
    return found


# ---------------------------------------------------------------- cheap checks


def test_compose_file_shape():
    yaml = pytest.importorskip("yaml")
    spec = yaml.safe_load(COMPOSE_FILE.read_text())
    # Compose v1 (1.29) and v2 both: no top-level name (v1 rejects it), no version (v2 warns).
    assert not {"name", "version"} & set(spec)
    services = spec["services"]
    assert {"gateway", "verifier", "drafter-dm", "drafter-ngram", "prometheus", "grafana", "otel-collector"} <= set(services)
    for name, svc in services.items():
        assert "healthcheck" in svc, f"{name} has no healthcheck"
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert cond == {"condition": "service_healthy"}, f"{name} -> {dep}"
    assert services["drafter-ngram"]["profiles"] == ["ngram"]
    assert services["otel-collector"]["profiles"] == ["otel"]
    for name in ("gateway", "verifier", "drafter-dm"):
        assert services[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "${SPECD_OTLP_ENDPOINT:-}"
    json.loads(DASHBOARD.read_text())


@pytest.mark.parametrize("binary", compose_binaries() or [None], ids=lambda b: " ".join(b) if b else "none")
def test_compose_config_is_valid(binary):
    if binary is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed")
    for profiles in ([], ["--profile", "ngram", "--profile", "monitoring", "--profile", "otel"]):
        out = subprocess.run([*binary, "-f", str(COMPOSE_FILE), *profiles, "config", "-q"], capture_output=True,
                             text=True, cwd=ROOT)
        assert out.returncode == 0, out.stderr


def test_swap_helpers():
    assert next_name("dm", set()) == "dm-2"
    assert next_name("dm-2", {"dm-3"}) == "dm-4"
    assert split_host("drafter-dm:50061") == "drafter-dm" and split_host("[::1]:5") == "::1"
    old = ["drafter", "--method", "draft_model", "--model", "/m", "--name", "dm", "--port", "50061"]
    assert drafter_command(old, "dm-2", None, None) == ["drafter", "--method", "draft_model", "--model", "/m",
                                                        "--name", "dm-2", "--port", "50061"]
    # another method drops the old draft model unless a model is given
    assert "--model" not in drafter_command(old, "x", "ngram", None)
    assert drafter_command(old + ["--model=/z"], "x", None, "/n") == ["drafter", "--method", "draft_model", "--model",
                                                                      "/n", "--name", "x", "--port", "50061"]
    assert drafter_command([], "x", "ngram", None)[:1] == ["drafter"]


# ---------------------------------------------------------------- the stack


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def serve_dir(directory: str, host: str) -> http.server.ThreadingHTTPServer:
    server = http.server.ThreadingHTTPServer((host, 0), functools.partial(QuietHandler, directory=directory))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class Stack:
    def __init__(self, client, compose: list[str], project: str, env: dict, ports: dict):
        self.client, self.compose, self.project, self.env, self.ports = client, compose, project, env, ports

    def run(self, *args, check=True, timeout=1800) -> subprocess.CompletedProcess:
        out = subprocess.run([*self.compose, "-f", str(COMPOSE_FILE), "-p", self.project, *args], env=self.env,
                             cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"compose {' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        return out

    def containers(self) -> list:
        return self.client.containers.list(all=True, filters={"label": f"com.docker.compose.project={self.project}"})

    def container(self, service: str):
        found = [c for c in self.containers() if c.labels.get("com.docker.compose.service") == service
                 and c.status == "running"]
        assert found, f"no running container for {service}"
        return found[0]

    def ip(self, container) -> str:
        return next(iter(container.attrs["NetworkSettings"]["Networks"].values()))["IPAddress"]

    @property
    def verifier(self) -> str:
        return f"127.0.0.1:{self.ports['SPECD_VERIFIER_PORT']}"

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.ports['SPECD_GATEWAY_PORT']}"

    @property
    def prometheus(self) -> str:
        return f"http://127.0.0.1:{self.ports['SPECD_PROMETHEUS_PORT']}"

    def drafters(self) -> dict:
        import grpc

        from specd.v1 import verifier_pb2 as pb
        from specd.v1 import verifier_pb2_grpc as pbg

        with grpc.insecure_channel(self.verifier) as channel:
            reply = pbg.VerifierStub(channel).ListDrafters(pb.ListDraftersRequest(), timeout=10)
        return {d.name: d for d in reply.drafters}


def wait(cond, timeout: float, what: str, interval: float = 1.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = cond()
        except Exception:  # noqa: BLE001 — not up yet
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


@pytest.fixture(scope="module")
def stack(request):
    markexpr = request.config.getoption("markexpr") or ""
    if "docker" not in markexpr or "not docker" in markexpr:
        pytest.skip("builds images and runs compose.yaml for minutes: run `make compose-test` (pytest -m docker)")
    docker = pytest.importorskip("docker", reason="the Docker SDK is missing: pip install 'specd[docker]'")
    try:
        client = docker.from_env()
        client.ping()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"no Docker engine reachable ({str(e).splitlines()[0] if str(e) else type(e).__name__})")
    binaries = compose_binaries()
    if not binaries:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed")

    env = dict(os.environ)
    if "SPECD_BASE_IMAGE" not in env:
        try:
            client.images.get("specd-base:bookworm")
            env["SPECD_BASE_IMAGE"] = "specd-base:bookworm"
        except docker.errors.ImageNotFound:
            env["SPECD_BASE_IMAGE"] = "python:3.11-slim"
    # Local wheel directories reach the image builds over HTTP on the docker bridge's gateway.
    wheel_dirs = [d for d in (env.get("SPECD_WHEELHOUSE", "").split(os.pathsep) if env.get("SPECD_WHEELHOUSE")
                              else env.get("PIP_FIND_LINKS", "").split()) if d and os.path.isdir(d)]
    servers, pip_args = [], [env.get("SPECD_EXTRA_PIP_ARGS", "")]
    if wheel_dirs:
        ipam = client.networks.get("bridge").attrs["IPAM"]["Config"][0]  # Gateway is absent on some engines
        bridge_ip = ipam.get("Gateway") or str(ipaddress.ip_network(ipam["Subnet"])[1])
        for d in wheel_dirs:
            servers.append(serve_dir(d, bridge_ip))
            pip_args.append(f"--find-links http://{bridge_ip}:{servers[-1].server_address[1]}/")
        pip_args.append(f"--trusted-host {bridge_ip}")
        if "SPECD_TORCH_INDEX_URL" not in env and any(p.name.startswith("torch-") and "+cpu" in p.name
                                                      for d in wheel_dirs for p in Path(d).glob("*.whl")):
            env["SPECD_TORCH_INDEX_URL"] = ""  # the wheelhouse has the CPU torch: no PyTorch index needed
    env["SPECD_EXTRA_PIP_ARGS"] = " ".join(a for a in pip_args if a)
    ports = {k: str(free_port()) for k in ("SPECD_GATEWAY_PORT", "SPECD_VERIFIER_PORT", "SPECD_PROMETHEUS_PORT")}
    env.update(ports)
    project = f"specdtest{os.getpid()}"
    stack = Stack(client, binaries[0], project, env, ports)
    report(f"compose: {' '.join(stack.compose)}; project {project}; base image {env['SPECD_BASE_IMAGE']}; "
           f"wheelhouse {wheel_dirs or 'none'}; ports {ports}")
    try:
        t0 = time.monotonic()
        stack.run(*PROFILES, "build")
        report(f"images built in {time.monotonic() - t0:.1f} s: "
               + ", ".join(f"{t} {client.images.get(t).attrs['Size'] / 1e6:.0f} MB"
                           for t in ("specd-verifier", "specd-drafter", "specd-gateway", "specd-prometheus")))
        t0 = time.monotonic()
        stack.run(*PROFILES, "up", "-d")
        report(f"`up -d` returned after {time.monotonic() - t0:.1f} s")

        def all_healthy():
            states = {}
            for c in stack.containers():
                service = c.labels["com.docker.compose.service"]
                if service in ONE_SHOT:
                    assert c.status != "exited" or c.attrs["State"]["ExitCode"] == 0, f"{service} failed"
                    states[service] = c.status == "exited"
                else:
                    states[service] = (c.attrs["State"].get("Health") or {}).get("Status") == "healthy"
            return len(states) >= 6 and all(states.values())

        wait(all_healthy, 600, "every container healthy")
        wait(lambda: {"dm", "ng"} <= {n for n, d in stack.drafters().items() if d.healthy}, 120,
             "drafters dm and ng registered and healthy")
        report(f"stack healthy {time.monotonic() - t0:.1f} s after `up -d`: "
               + ", ".join(sorted(c.name for c in stack.containers())))
        yield stack
    finally:
        if request.session.testsfailed:
            logs = stack.run(*PROFILES, "logs", "--tail", "40", check=False)
            report("service logs (last 40 lines each):\n" + logs.stdout[-12000:])
        t0 = time.monotonic()
        stack.run(*PROFILES, "down", "-v", "--remove-orphans", check=False)
        report(f"`down -v` took {time.monotonic() - t0:.1f} s; left behind: "
               f"{[c.name for c in stack.containers()] or 'nothing'}")
        for server in servers:
            server.shutdown()


def openai_client(stack):
    import openai

    return openai.OpenAI(base_url=f"{stack.gateway}/v1", api_key="unused", max_retries=0, timeout=300)


def complete(client, prompt: str, **speculative) -> tuple[str, dict]:
    """One streamed greedy completion: (text, usage.speculative)."""
    text, usage = "", None
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"speculative": speculative} if speculative else None):
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.usage is not None:
            usage = chunk.usage
    return text, usage.model_extra["speculative"]


@pytest.mark.docker
@pytest.mark.timeout(2400)
def test_streamed_chat_completion(stack):
    client = openai_client(stack)
    t0 = time.monotonic()
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "def fibonacci(n):"}],
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True)
    parts, finish = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    text = "".join(parts)
    report(f"chat completion: {len(parts)} chunks in {time.monotonic() - t0:.2f} s, finish {finish}: {text[:60]!r}")
    assert text.strip() and finish in ("stop", "length")


@pytest.mark.docker
def test_prometheus_scrapes_every_service(stack):
    from prometheus_client.parser import text_string_to_metric_families

    complete(openai_client(stack), PROMPTS[0])  # so the speculation counters have series

    def targets_up():
        targets = json.load(urllib.request.urlopen(f"{stack.prometheus}/api/v1/targets", timeout=5))["data"]["activeTargets"]
        jobs = {}
        for t in targets:
            jobs.setdefault(t["labels"]["job"], []).append(t["health"])
        ok = set(jobs) >= {"gateway", "verifier", "drafters"} and len(jobs["drafters"]) == 2 and \
            all(h == "up" for hs in jobs.values() for h in hs)
        return jobs if ok else None

    jobs = wait(targets_up, 90, "every Prometheus target up")
    report(f"Prometheus targets: {jobs}")
    # And from the host: every service's own /metrics, parsed by the reference parser.
    expected = {"gateway": (8000, "specd_gateway_time_to_first_token_seconds"),
                "verifier": (9401, "specd_spec_decode_num_draft_tokens"),
                "drafter-dm": (9402, "specd_drafter_propose_batches"),
                "drafter-ngram": (9402, "specd_drafter_propose_batches")}
    for service, (port, family) in expected.items():
        url = f"http://{stack.ip(stack.container(service))}:{port}/metrics"
        families = {f.name: f for f in text_string_to_metric_families(urllib.request.urlopen(url, timeout=5).read().decode())}
        assert family in families, f"{service}: {family} missing from {url}"
    ok = json.load(urllib.request.urlopen(f"{stack.prometheus}/api/v1/query?query=specd_spec_decode_num_draft_tokens_total",
                                          timeout=5))
    assert ok["status"] == "success"


@pytest.mark.docker
def test_dashboard_queries_evaluate(stack):
    """Every Grafana panel's PromQL (with its variables filled in) is valid in this Prometheus."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    for expr in exprs:
        q = expr.replace("$drafter", ".*").replace("$__rate_interval", "1m")
        url = f"{stack.prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": q})
        reply = json.load(urllib.request.urlopen(url, timeout=10))
        assert reply["status"] == "success", (expr, reply)
    report(f"{len(exprs)} dashboard queries evaluate in Prometheus")


@pytest.mark.docker
@pytest.mark.timeout(1200)
def test_swap_drafter_container_under_load(stack):
    client = openai_client(stack)
    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        reference = [t for t, _ in ex.map(lambda p: complete(client, p, num_speculative_tokens=0), PROMPTS)]
    old = stack.container("drafter-dm")
    swap = subprocess.Popen([sys.executable, "-m", "specd.cli", "drafters", "swap", "--old", "dm", "--image",
                             "specd-drafter", "--verifier", stack.verifier], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    t0, rounds, failures = time.monotonic(), 0, []
    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        # Rounds of 8 concurrent streams until the swap is over, then one more: streams are in
        # flight through every step (start, health wait, register, drain, old container stop).
        while True:
            done = swap.poll() is not None
            futures = [ex.submit(complete, client, p) for p in PROMPTS]
            for i, f in enumerate(futures):
                try:
                    text, _ = f.result()
                    if text != reference[i]:
                        failures.append(f"round {rounds} prompt {i}: {text!r} != {reference[i]!r}")
                except Exception as e:  # noqa: BLE001
                    failures.append(f"round {rounds} prompt {i}: {type(e).__name__}: {e}")
            rounds += 1
            if done:
                break
    out = swap.stdout.read()
    report(f"swap (exit {swap.returncode}) with {rounds} rounds of {len(PROMPTS)} streams in "
           f"{time.monotonic() - t0:.1f} s:\n{out.rstrip()}")
    assert swap.returncode == 0, out
    assert not failures, "\n".join(failures)
    drafters = stack.drafters()
    assert "dm" not in drafters and drafters["dm-2"].healthy
    with pytest.raises(Exception):
        old.reload()  # the old container is gone
    new = stack.container("drafter-dm")  # compose labels travelled: the stack owns it
    assert new.name.endswith("drafter-dm-2")
    text, spec = complete(client, PROMPTS[1], drafter="dm-2")
    assert text == reference[1] and spec["draft_tokens"] > 0
    # The new container took over the `drafter-dm` alias, so Prometheus scrapes it unprompted.
    query = f"{stack.prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": 'specd_drafter_up{drafter="dm-2"}'})
    wait(lambda: json.load(urllib.request.urlopen(query, timeout=5))["data"]["result"], 60, "Prometheus scraping dm-2")


@pytest.mark.docker
def test_swap_rolls_back_when_the_new_drafter_never_serves(stack):
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "specd.cli", "drafters", "swap", "--old", "dm-2", "--image",
                          "specd-drafter", "--model", "/nonexistent", "--verifier", stack.verifier],
                         capture_output=True, text=True, timeout=600)
    report(f"failing swap (exit {out.returncode}) in {time.monotonic() - t0:.1f} s: {out.stderr.strip()}")
    assert out.returncode == 1
    assert re.search(r"^error: .*rolled back: \S+-drafter-dm-3 removed, dm-2 still serves$", out.stderr.strip())
    assert stack.drafters()["dm-2"].healthy
    assert not [c for c in stack.containers() if c.name.endswith("drafter-dm-3")]
    text, spec = complete(openai_client(stack), PROMPTS[2], drafter="dm-2")
    assert text and spec["draft_tokens"] > 0
