"""Start a compose stack for the `docker`-marked tests (test_compose.py, test_compose_secure.py).

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
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from specd import auth

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose.yaml"
SECURE_FILE = ROOT / "compose.secure.yaml"
MODEL = "specd-demo-target"
MAX_TOKENS = 48
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


def make_secrets(directory: Path) -> Path:
    """deploy/make-secrets.sh into directory (skips where openssl is missing)."""
    if shutil.which("openssl") is None:
        pytest.skip("deploy/make-secrets.sh needs the openssl command line")
    subprocess.run([str(ROOT / "deploy" / "make-secrets.sh"), str(directory)], check=True, capture_output=True)
    return directory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@functools.lru_cache(maxsize=None)
def serve_dir(directory: str, host: str) -> http.server.ThreadingHTTPServer:
    """One server per directory for the whole session: the same port gives the same build
    arguments, so a second stack reuses the first one's image layers."""
    server = http.server.ThreadingHTTPServer((host, 0), functools.partial(QuietHandler, directory=directory))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class Stack:
    def __init__(self, client, compose: list[str], files: list[Path], project: str, env: dict, ports: dict,
                 security: auth.Security | None = None):
        self.client, self.compose, self.files, self.project, self.env, self.ports = \
            client, compose, files, project, env, ports
        self.security = security or auth.Security()

    def run(self, *args, check=True, timeout=1800) -> subprocess.CompletedProcess:
        files = [a for f in self.files for a in ("-f", str(f))]
        out = subprocess.run([*self.compose, *files, "-p", self.project, *args], env=self.env,
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
        scheme = "https" if self.security.tls_ca else "http"
        return f"{scheme}://127.0.0.1:{self.ports['SPECD_GATEWAY_PORT']}"

    @property
    def prometheus(self) -> str:
        return f"http://127.0.0.1:{self.ports['SPECD_PROMETHEUS_PORT']}"

    def drafters(self) -> dict:
        from specd.v1 import verifier_pb2 as pb
        from specd.v1 import verifier_pb2_grpc as pbg

        with auth.sync_channel(self.verifier, self.security, auth.VERIFIER) as channel:
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


def start_stack(request, files: list[Path], profiles: list[str], extra_env: dict | None = None,
                security: auth.Security | None = None):
    """Build, `up -d`, wait for every container healthy and drafters dm and ng registered;
    yields the Stack, then `down -v`. Skips unless run with `-m docker` and an engine is there."""
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

    env = {**os.environ, **(extra_env or {})}
    if "SPECD_BASE_IMAGE" not in env:
        try:
            client.images.get("specd-base:bookworm")
            env["SPECD_BASE_IMAGE"] = "specd-base:bookworm"
        except docker.errors.ImageNotFound:
            env["SPECD_BASE_IMAGE"] = "python:3.11-slim"
    # Local wheel directories reach the image builds over HTTP on the docker bridge's gateway.
    wheel_dirs = [d for d in (env.get("SPECD_WHEELHOUSE", "").split(os.pathsep) if env.get("SPECD_WHEELHOUSE")
                              else env.get("PIP_FIND_LINKS", "").split()) if d and os.path.isdir(d)]
    pip_args = [env.get("SPECD_EXTRA_PIP_ARGS", "")]
    if wheel_dirs:
        ipam = client.networks.get("bridge").attrs["IPAM"]["Config"][0]  # Gateway is absent on some engines
        bridge_ip = ipam.get("Gateway") or str(ipaddress.ip_network(ipam["Subnet"])[1])
        for d in wheel_dirs:
            pip_args.append(f"--find-links http://{bridge_ip}:{serve_dir(d, bridge_ip).server_address[1]}/")
        pip_args.append(f"--trusted-host {bridge_ip}")
        if "SPECD_TORCH_INDEX_URL" not in env and any(p.name.startswith("torch-") and "+cpu" in p.name
                                                      for d in wheel_dirs for p in Path(d).glob("*.whl")):
            env["SPECD_TORCH_INDEX_URL"] = ""  # the wheelhouse has the CPU torch: no PyTorch index needed
    env["SPECD_EXTRA_PIP_ARGS"] = " ".join(a for a in pip_args if a)
    ports = {k: str(free_port()) for k in ("SPECD_GATEWAY_PORT", "SPECD_VERIFIER_PORT", "SPECD_PROMETHEUS_PORT")}
    env.update(ports)
    project = f"specdtest{os.getpid()}{'s' if SECURE_FILE in files else ''}"
    stack = Stack(client, binaries[0], files, project, env, ports, security)
    report(f"compose: {' '.join(stack.compose)} -f {' -f '.join(f.name for f in files)}; project {project}; "
           f"base image {env['SPECD_BASE_IMAGE']}; wheelhouse {wheel_dirs or 'none'}; ports {ports}")
    try:
        t0 = time.monotonic()
        stack.run(*profiles, "build")
        report(f"images built in {time.monotonic() - t0:.1f} s: "
               + ", ".join(f"{t} {client.images.get(t).attrs['Size'] / 1e6:.0f} MB"
                           for t in ("specd-verifier", "specd-drafter", "specd-gateway", "specd-prometheus")))
        t0 = time.monotonic()
        stack.run(*profiles, "up", "-d")
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
            logs = stack.run(*profiles, "logs", "--tail", "40", check=False)
            report("service logs (last 40 lines each):\n" + logs.stdout[-12000:])
        t0 = time.monotonic()
        stack.run(*profiles, "down", "-v", "--remove-orphans", check=False)
        report(f"`down -v` took {time.monotonic() - t0:.1f} s; left behind: "
               f"{[c.name for c in stack.containers()] or 'nothing'}")


def openai_client(stack):
    import ssl

    import httpx
    import openai

    verify = ssl.create_default_context(cafile=stack.security.tls_ca) if stack.security.tls_ca else True
    return openai.OpenAI(base_url=f"{stack.gateway}/v1", api_key="unused", max_retries=0, timeout=300,
                         http_client=httpx.Client(verify=verify, timeout=300))


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
