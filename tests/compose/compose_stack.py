"""Start a compose stack for the `docker`-marked tests (test_compose.py, test_compose_secure.py).

The images are built the documented registry-free way: the base image from
deploy/build-base-image.sh where it exists, and the CPU torch wheel from wheels/ in the build
context (wheels/README.md). Where wheels/ lacks it, the wheel is copied in from a local wheel
directory (PIP_FIND_LINKS), the README's `cp` step; no wheel is served over HTTP and no second
pip index is passed.

Environment:
  SPECD_BASE_IMAGE       base image (default specd-base:bookworm if built, else python:3.11-slim)
  SPECD_EXTRA_PIP_ARGS   passed on to compose.yaml's build arguments (e.g. a mirror)
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specd.rpc import auth

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose.yaml"
SECURE_FILE = ROOT / "compose.secure.yaml"
WHEELS = ROOT / "wheels"
MODEL = "SmolLM2-135M-Instruct"  # the default pair, baked into the images
MAX_TOKENS = 32


def report(msg: str) -> None:
    """Progress and timings, in the test log (run with -s)."""
    print(f"[compose-test {time.strftime('%H:%M:%S')}] {msg}", flush=True)


OFFLINE_REFERENCE = """
import json, sys
import torch
torch.set_num_threads(1)  # (bf16 on the fused CPU ops gives the same tokens at any thread count)
from specd import LLM, SamplingParams
from specd.models.chat import chat_prompt_ids
from specd.models.model_store import fetch
llm = LLM(str(fetch()[0]), dtype=sys.argv[3])  # the checksummed target the images carry, in the stack's dtype
prompts = [p if isinstance(p, str) else {"prompt_token_ids": chat_prompt_ids(llm.tokenizer, p)}
           for p in json.loads(sys.argv[1])]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=int(sys.argv[2])))
print(json.dumps([o.text for o in outs]))
"""


def offline_reference(prompts: list, client) -> list[str]:
    """Greedy texts from the offline engine on the host (same weights and dtype as the stack,
    whose dtype /v1/models reports): a str is a completion prompt, a list of messages a chat."""
    dtype = client.models.list().data[0].model_extra["dtype"]
    out = subprocess.run([sys.executable, "-c", OFFLINE_REFERENCE, json.dumps(prompts), str(MAX_TOKENS), dtype],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


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


def torch_pin() -> str:
    return re.search(r'"torch==([^";]+)"', (ROOT / "pyproject.toml").read_text()).group(1)


def ensure_cpu_torch_wheel() -> Path:
    """wheels/ holds the pinned CPU torch wheel (copied from a local wheel directory if not yet)."""
    pattern = f"torch-{torch_pin()}+cpu-cp311-cp311-*.whl"  # the base images' Python is 3.11
    found = sorted(WHEELS.glob(pattern))
    if found:
        return found[0]
    for d in os.environ.get("PIP_FIND_LINKS", "").split():
        for wheel in sorted(Path(d).glob(pattern)) if os.path.isdir(d) else []:
            shutil.copy(wheel, WHEELS / wheel.name)  # wheels/README.md: `cp ... wheels/`
            report(f"copied {wheel} to wheels/")
            return WHEELS / wheel.name
    pytest.skip(f"wheels/ has no {pattern} and no local wheel directory has one: fill it as wheels/README.md says")


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
        """The verifier's loopback admin address (the first replica's when scaled)."""
        return self.verifiers()[0]

    def verifiers(self) -> list[str]:
        """Every replica's loopback admin address: its published port (`compose port --index N`)."""
        if self.ports.get("SPECD_VERIFIER_PORT"):
            return [f"127.0.0.1:{self.ports['SPECD_VERIFIER_PORT']}"]
        n = len([c for c in self.containers() if c.labels.get("com.docker.compose.service") == "verifier"
                 and c.status == "running"])
        return [self.run("port", "--index", str(i), "verifier", "50051").stdout.strip() for i in range(1, n + 1)]

    @property
    def gateway(self) -> str:
        scheme = "https" if self.security.tls_ca else "http"
        return f"{scheme}://127.0.0.1:{self.ports['SPECD_GATEWAY_PORT']}"

    @property
    def prometheus(self) -> str:
        return f"http://127.0.0.1:{self.ports['SPECD_PROMETHEUS_PORT']}"

    def drafters(self, verifier: str | None = None) -> dict:
        from specd.v1 import verifier_pb2 as pb
        from specd.v1 import verifier_pb2_grpc as pbg

        with auth.sync_channel(verifier or self.verifier, self.security, auth.VERIFIER) as channel:
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


def docker_client(request):
    """(the docker module, a client), or a skip unless run with `-m docker` and an engine is there."""
    markexpr = request.config.getoption("markexpr") or ""
    if "docker" not in markexpr or "not docker" in markexpr:
        pytest.skip("builds images and runs compose.yaml for minutes: run `make compose-test` (pytest -m docker)")
    docker = pytest.importorskip("docker", reason="the Docker SDK is missing: pip install 'specd[docker]'")
    try:
        client = docker.from_env()
        client.ping()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"no Docker engine reachable ({str(e).splitlines()[0] if str(e) else type(e).__name__})")
    return docker, client


def start_stack(request, files: list[Path], profiles: list[str], extra_env: dict | None = None,
                security: auth.Security | None = None, verifiers: int = 1):
    """Build, `up -d` (`--scale verifier=N` for verifiers > 1), wait for every container healthy
    and drafters dm and ng registered at every verifier replica; yields the Stack, then `down -v`.
    Skips unless run with `-m docker` and an engine is there."""
    docker, client = docker_client(request)
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
    for key in ("SPECD_TORCH_VARIANT", "SPECD_TORCH_INDEX_URL", "SPECD_IMAGE_TAG", "SPECD_TARGET",
                "SPECD_DRAFTER", "SPECD_DATASTORE", "SPECD_MODELS"):
        env.pop(key, None)  # the defaults: CPU torch from wheels/, the default pair, :latest
    wheel = ensure_cpu_torch_wheel()
    ports = {k: str(free_port()) for k in ("SPECD_GATEWAY_PORT", "SPECD_VERIFIER_PORT", "SPECD_PROMETHEUS_PORT")}
    if verifiers > 1:
        ports["SPECD_VERIFIER_PORT"] = ""  # a free loopback port per replica, as compose.yaml's default
    env.update(ports)
    project = f"specdtest{os.getpid()}{'s' if SECURE_FILE in files else ''}{f'x{verifiers}' if verifiers > 1 else ''}"
    stack = Stack(client, binaries[0], files, project, env, ports, security)
    report(f"compose: {' '.join(stack.compose)} -f {' -f '.join(f.name for f in files)}; project {project}; "
           f"base image {env['SPECD_BASE_IMAGE']}; torch from wheels/{wheel.name}; ports {ports}")
    try:
        t0 = time.monotonic()
        # v1 builds with the classic builder: --force-rm removes a failed step's container too
        stack.run(*profiles, "build", *(["--force-rm"] if stack.compose == ["docker-compose"] else []))
        report(f"images built in {time.monotonic() - t0:.1f} s: "
               + ", ".join(f"{t} {client.images.get(t).attrs['Size'] / 1e6:.0f} MB"
                           for t in ("specd-verifier", "specd-drafter", "specd-gateway", "specd-prometheus")))
        t0 = time.monotonic()
        scale = ["--scale", f"verifier={verifiers}"] if verifiers > 1 else []
        stack.run(*profiles, "up", "-d", *scale)
        report(f"`up -d {' '.join(scale)}` returned after {time.monotonic() - t0:.1f} s")
        # gateway, prometheus, drafter-dm, (drafter-ngram) and the verifier replicas
        ngram = "ngram" in profiles
        wait(lambda: all_healthy(stack, 3 + ngram + verifiers), 600, "every container healthy")
        drafters = {"dm", "ng"} if ngram else {"dm"}
        wait(lambda: all(drafters <= {n for n, d in stack.drafters(v).items() if d.healthy}
                         for v in stack.verifiers()), 120,
             f"drafters {' and '.join(sorted(drafters))} registered and healthy at every verifier replica")
        report(f"stack healthy {time.monotonic() - t0:.1f} s after `up -d`: "
               + ", ".join(sorted(c.name for c in stack.containers())))
        yield stack
    finally:
        if request.session.testsfailed:
            logs = stack.run(*profiles, "logs", "--tail", "40", check=False)
            report("service logs (last 40 lines each):\n" + logs.stdout[-12000:])
        t0 = time.monotonic()
        stack.run("--profile", "ngram", "down", "-v", "--remove-orphans", check=False)  # a test may have added it
        report(f"`down -v` took {time.monotonic() - t0:.1f} s; left behind: "
               f"{[c.name for c in stack.containers()] or 'nothing'}")


def all_healthy(stack, expected: int) -> bool:
    """expected containers of the stack running, each healthy."""
    states = {c.name: (c.attrs["State"].get("Health") or {}).get("Status") == "healthy"
              for c in stack.containers() if c.status == "running"}
    return len(states) >= expected and all(states.values())


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
