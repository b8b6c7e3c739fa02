"""compose.yaml as an operator runs it, and `specd drafters swap` on real containers.

Cheap checks (no Docker engine needed) run with the rest of the suite: the shape of
compose.yaml and of compose.secure.yaml (its commands are compose.yaml's plus the secrets'
flags), `docker-compose config -q` / `docker compose config -q` where a binary exists (with
and without the secure override), deploy/Dockerfile's stages (a target per image) and torch
variants (deploy/docker/install-torch.sh run with a stand-in pip: the missing CPU wheel stops it with
the command that fills wheels/, a CUDA tag asks the PyTorch index for it alone, matching the
Kubernetes GPU overlay's :cuda images), deploy/make-secrets.sh's certificate serving gRPC TLS
to the containers' healthcheck, and the pure helpers of specd/cli/docker_swap.py.

The `docker`-marked tests build the images the registry-free way (compose_stack.py), start
the stack (`--profile ngram`; Grafana's image is not there and is never pulled), and check,
through the published ports, on the default pair (SmolLM2-135M-Instruct with its trained
drafter): a streamed chat completion via the official `openai` client; Prometheus scraping
every service (plus each /metrics parsed from the host); the Grafana dashboard's queries
evaluating in Prometheus; a drafter container swapped while 8 streams run (no failed request,
greedy text equal to the offline engine's on the same weights and dtype); a swap that rolls
back; a `--profile monitoring up` whose image cannot be pulled failing alone. They run only
when asked for (`make compose-test`, or `pytest -m docker tests/compose`): building takes
minutes. `docker compose down -v` at the end. test_compose_secure.py does the same with
compose.secure.yaml (secrets, TLS, trusted drafters).

Environment: see compose_stack.py.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from compose_stack import (COMPOSE_FILE, MAX_TOKENS, MODEL, ROOT, SECURE_FILE, complete, compose_binaries,
                           docker_client, make_secrets, offline_reference, openai_client, report, start_stack, wait)

from specd.rpc import auth
from specd.cli.docker_swap import (drafter_command, health_command, next_name, register_request, secret_volumes,
                               split_host)
from specd.v1 import verifier_pb2 as pb

DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "specd.json"
PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n", "class Parser:\n    def __init__(self",
           "for i in range(10):\n    ", "    return self.", "def main():\n    args = ", "if __name__ == ",
           "with open(path) as f:\n    "]
PROFILES = ["--profile", "ngram"]


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
    # The default pair, whose weights the images carry (deploy/Dockerfile, models stage).
    verifier, dm = services["verifier"]["command"], services["drafter-dm"]["command"]
    assert verifier[verifier.index("--model") + 1] == "${SPECD_TARGET:-/opt/specd/cache/models/SmolLM2-135M-Instruct}"
    assert dm[dm.index("--model") + 1] == \
        "${SPECD_DRAFTER:-/opt/specd/cache/models/SmolLM2-135M-Instruct-drafter}"
    # A user's models come from a host directory (SPECD_MODELS), the same path in both containers.
    for name in ("verifier", "drafter-dm"):
        assert services[name]["volumes"] == ["${SPECD_MODELS:-./models}:/models:ro"], name
    # The suffix index inside the verifier drafts from the default target's datastore, which the
    # verifier image carries with the committed models/ (at /opt/specd/models).
    local = json.loads(verifier[verifier.index("--local-drafter") + 1].removeprefix("suffix:"))
    store = "${SPECD_DATASTORE-/opt/specd/models/SmolLM2-135M-Instruct-datastore}"
    assert local == {"suffix_decoding_datastore": store}
    assert (ROOT / "models" / store.rpartition("/")[2].rstrip("}") / "datastore.npz").is_file()
    for name in ("verifier", "drafter-dm", "drafter-ngram"):
        cmd = services[name]["command"]
        threads = "${SPECD_VERIFIER_THREADS:-auto}" if name == "verifier" else "${SPECD_THREADS:-1}"
        assert cmd[cmd.index("--threads") + 1] == threads, name
    # Only the Docker Hub images' profiles pull; everything else is built here.
    for name, svc in services.items():
        pulled = "build" not in svc
        assert pulled == (name in ("grafana", "otel-collector")), name
        if pulled:
            assert svc["profiles"], f"{name} pulls from a registry: it must stay out of the default `up`"
    args = spec["x-build-args"]
    assert args["TORCH_VARIANT"] == "${SPECD_TORCH_VARIANT:-cpu}" and args["TORCH_INDEX_URL"] == "${SPECD_TORCH_INDEX_URL:-}"
    # Every specd image from the one Dockerfile, its own target of it, with the same arguments.
    stages = dockerfile_stages(DOCKERFILE.read_text())
    for name, target in {"verifier": "verifier", "drafter-dm": "drafter", "drafter-ngram": "drafter",
                         "gateway": "gateway"}.items():
        assert services[name]["build"] == {"context": ".", "dockerfile": "deploy/Dockerfile", "target": target,
                                           "args": args}, name
        assert services[name]["image"].startswith(f"specd-{target}:") and target in stages, name


@pytest.mark.parametrize("binary", compose_binaries() or [None], ids=lambda b: " ".join(b) if b else "none")
def test_compose_config_is_valid(binary, tmp_path):
    if binary is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed")
    all_profiles = ["--profile", "ngram", "--profile", "monitoring", "--profile", "otel"]
    for profiles in ([], all_profiles):
        out = subprocess.run([*binary, "-f", str(COMPOSE_FILE), *profiles, "config", "-q"], capture_output=True,
                             text=True, cwd=ROOT)
        assert out.returncode == 0, out.stderr
    # The secure override on top, with secrets from deploy/make-secrets.sh: valid, and the
    # rendered file mounts those files and passes the flags.
    secrets = make_secrets(tmp_path / "secrets")
    env = {**os.environ, "SPECD_SECRETS_DIR": str(secrets)}
    out = subprocess.run([*binary, "-f", str(COMPOSE_FILE), "-f", str(SECURE_FILE), *all_profiles, "config"],
                         capture_output=True, text=True, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr
    yaml = pytest.importorskip("yaml")
    spec = yaml.safe_load(out.stdout)
    assert {k: v["file"] for k, v in spec["secrets"].items()} == {
        "specd-auth-token": str(secrets / "auth-token"), "specd-tls-cert": str(secrets / "tls.crt"),
        "specd-tls-key": str(secrets / "tls.key"), "specd-tls-ca": str(secrets / "ca.crt")}
    verifier = spec["services"]["verifier"]
    assert "--auth-token-file" in verifier["command"] and "--trusted-drafter" in verifier["command"]
    assert {s["source"] if isinstance(s, dict) else s for s in verifier["secrets"]} == set(spec["secrets"])
    # v1 renders a bind mount as "SRC:DST:ro", v2 in the long syntax
    mounts = [v if isinstance(v, str) else f"{v['source']}:{v['target']}{':ro' if v.get('read_only') else ''}"
              for v in spec["services"]["prometheus"]["volumes"]]
    assert any(v.endswith("prometheus-secure.yml:/etc/specd/prometheus.yml:ro") for v in mounts), mounts


DOCKERFILE = ROOT / "deploy" / "Dockerfile"
TARGETS = ("verifier", "drafter", "gateway")
INSTALL_TORCH = ROOT / "deploy" / "docker" / "install-torch.sh"


def dockerfile_stages(text: str) -> dict[str, tuple[str, str]]:
    """A Dockerfile's stages in file order: name -> (the image or stage it is FROM, its
    instructions without comment lines)."""
    parts = re.split(r"^FROM (\S+) AS (\S+)\n", text, flags=re.M)
    assert len(re.findall(r"^FROM ", text, flags=re.M)) == len(parts) // 3, "a stage without a name"
    return {name: (base, "\n".join(line for line in body.splitlines() if not line.lstrip().startswith("#")))
            for base, name, body in zip(parts[1::3], parts[2::3], parts[3::3])}


def test_dockerfile_targets_share_stages_and_need_no_second_index():
    text = DOCKERFILE.read_text()
    stages = dockerfile_stages(text)
    names = list(stages)
    assert set(TARGETS) <= set(names)
    # Every stage is FROM, and copies from, only the base or stages above it: a target needs no
    # stage after it. The classic builder (docker-compose 1.29, DOCKER_BUILDKIT=0) builds every
    # stage above the target, so the gateway's own venv (a PyPI download) comes after the
    # verifier and drafter, whose builds then never make it.
    for i, (name, (base, body)) in enumerate(stages.items()):
        for used in (base, *re.findall(r"--from=(\S+)", body)):
            assert used == "${BASE_IMAGE}" or used in names[:i], f"{name} uses {used}, not a stage above it"
    assert names.index("verifier") < names.index("drafter") < names.index("gateway-deps") < names.index("gateway")
    assert "--extra-index-url" not in text and "download.pytorch.org" not in text
    assert "ARG TORCH_VARIANT=cpu" in stages["deps"][1] and "COPY wheels/ /opt/build/wheels/" in stages["deps"][1]
    for name in TARGETS:
        base, final = stages[name]
        serving = final + (stages[base][1] if base in stages else "")
        # the serving image: on the base (no build stage); no build tools, no wheels/; a venv and
        # a wheel of specd; the service's own command
        assert (stages[base][0] if base in stages else base) == "${BASE_IMAGE}", name
        assert "wheels/" not in serving and "apt-get" not in serving, name
        assert "pip install --no-deps --no-index" in final and 'ENTRYPOINT ["specd"]' in final, name
        assert re.search(rf'^CMD \["{name}", ', final, flags=re.M), name
    # the model services carry the CPU ops compiled in the cpu-ops stage, in a venv without
    # headers, and each its own weights
    for name in ("verifier", "drafter"):
        final = stages[name][1]
        assert "COPY --from=cpu-ops --chown=65534:65534 /opt/stage/cache /opt/specd/cache" in final, name
        assert "COPY --from=venv /opt/venv /opt/venv" in final, name
        assert f"COPY --from=models --chown=65534:65534 /opt/stage/{name} /opt/specd/cache" in final, name
    # the gateway's own venv has no torch; its final stage takes that venv, not deps'
    gateway = stages["gateway"][1]
    assert "--without torch" in stages["gateway-deps"][1] and "COPY --from=gateway-deps /opt/venv" in gateway
    assert "--from=venv" not in gateway and "--from=cpu-ops" not in gateway
    ignored = (ROOT / ".gitignore").read_text()
    assert "/wheels/*" in ignored and "!/wheels/README.md" in ignored and (ROOT / "wheels" / "README.md").is_file()
    assert "!wheels" in (ROOT / ".dockerignore").read_text()


def run_install_torch(tmp_path, variant: str, wheels: Path, index: str = "") -> tuple[subprocess.CompletedProcess, str]:
    """deploy/docker/install-torch.sh with a stand-in `pip` that records its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "pip").write_text('#!/bin/sh\necho "$@" >> "$PIP_LOG"\n')
    (bin_dir / "pip").chmod(0o755)
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # a symlink would leave the venv
    (bin_dir / "python").chmod(0o755)
    log = tmp_path / "pip.log"
    log.write_text("")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PIP_LOG": str(log),
           "TORCH_CONSTRAINT": str(tmp_path / "constraint.txt"), "EXTRA_PIP_ARGS": ""}
    out = subprocess.run(["sh", str(INSTALL_TORCH), variant, str(wheels), str(ROOT / "pyproject.toml"), index],
                         capture_output=True, text=True, env=env, timeout=120)
    return out, log.read_text()


def test_install_torch_variants(tmp_path):
    """The CPU build never reaches PyPI's CUDA torch: without the wheel in wheels/ it stops before
    any pip call, naming the command that fills wheels/; with it, pip gets that file. A CUDA tag
    (the Kubernetes GPU overlay's images) asks the PyTorch index for that build, alone."""
    pin = re.search(r'"torch==([^";]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    t0 = time.monotonic()
    out, pip_calls = run_install_torch(tmp_path, "cpu", wheels)
    assert out.returncode == 1 and pip_calls == "" and time.monotonic() - t0 < 30
    assert "error: TORCH_VARIANT=cpu, but wheels/" in out.stderr and "--index-url https://download.pytorch.org/whl/cpu" in out.stderr
    wheel = wheels / f"torch-{pin}+cpu-{tag}-{tag}-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"")
    out, pip_calls = run_install_torch(tmp_path, "cpu", wheels)
    torch_cuda = __import__("torch").version.cuda
    assert pip_calls.split() == ["install", str(wheel)]
    assert out.returncode == (1 if torch_cuda else 0), out.stderr  # the check imports this host's torch
    wheel.unlink()
    out, pip_calls = run_install_torch(tmp_path, "cu128", wheels)
    assert pip_calls.split() == ["install", "--index-url", "https://download.pytorch.org/whl/cu128", f"torch=={pin}+cu128"]
    if not torch_cuda:  # this host's CPU torch stands in for what pip would have installed
        assert out.returncode == 1 and "TORCH_VARIANT=cu128, but torch" in out.stderr
    out, pip_calls = run_install_torch(tmp_path, "cuda", wheels)  # PyPI's own torch: a CUDA build
    assert pip_calls.split() == ["install", f"torch=={pin}"]
    if not torch_cuda:
        assert out.returncode == 1 and "TORCH_VARIANT=cuda, but torch" in out.stderr
    # The GPU overlay expects exactly these images and build argument.
    gpu = ROOT / "deploy" / "k8s" / "overlays" / "gpu"
    overlay = "".join(p.read_text() for p in sorted(gpu.glob("*.yaml")))
    dockerfile, deploy_doc = DOCKERFILE.read_text(), (ROOT / "docs" / "deploy.md").read_text()
    for name in ("verifier", "drafter"):
        command = (f"docker build -f deploy/Dockerfile --target {name} --build-arg TORCH_VARIANT=cu128"
                   f" -t specd-{name}:cuda .")
        assert command in overlay and command in dockerfile and command in deploy_doc, name
        assert name in dockerfile_stages(dockerfile), name
    assert re.findall(r"image: (specd-\S+)", overlay) and \
        all(i.endswith(":cuda") for i in re.findall(r"image: (specd-\S+)", overlay))


# flag -> the secret it names (mounted at /run/secrets/<name>)
SECRET_FLAGS = {"--auth-token-file": "specd-auth-token", "--tls-cert": "specd-tls-cert", "--tls-key": "specd-tls-key",
                "--tls-ca": "specd-tls-ca", "--ssl-certfile": "specd-tls-cert", "--ssl-keyfile": "specd-tls-key"}


def test_secure_override_shape():
    yaml = pytest.importorskip("yaml")
    base = yaml.safe_load(COMPOSE_FILE.read_text())["services"]
    secure = yaml.safe_load(SECURE_FILE.read_text())
    assert not {"name", "version"} & set(secure)
    assert {k: v["file"] for k, v in secure["secrets"].items()} == {
        f"specd-{n}": "${SPECD_SECRETS_DIR:-./deploy/secrets}/" + f
        for n, f in (("auth-token", "auth-token"), ("tls-cert", "tls.crt"), ("tls-key", "tls.key"), ("tls-ca", "ca.crt"))}
    services = secure["services"]
    assert set(services) == {"verifier", "drafter-dm", "drafter-ngram", "gateway", "prometheus"}
    flags = {}
    for name, svc in services.items():
        if name == "prometheus":
            continue
        # compose.yaml's command plus secret flags (the only drift allowed: dm and ng become trusted)
        cmd, rest, flags[name] = svc["command"], [], {}
        i = 0
        while i < len(cmd):
            if cmd[i] in SECRET_FLAGS or cmd[i] == "--tls-server-name":
                flags[name][cmd[i]] = cmd[i + 1]
                i += 2
            else:
                rest.append(cmd[i])
                i += 1
        expected = ["--trusted-drafter" if a == "--drafter" else a for a in base[name]["command"]]
        assert rest == expected, name
        for flag, value in flags[name].items():
            if flag in SECRET_FLAGS:
                assert value == f"/run/secrets/{SECRET_FLAGS[flag]}" and SECRET_FLAGS[flag] in svc["secrets"], (name, flag)
        assert "--auth-token-file" in flags[name], name
    for server in ("verifier", "drafter-dm", "drafter-ngram"):
        assert {"--tls-cert", "--tls-key"} <= set(flags[server]), server
    for client in ("verifier", "gateway"):
        assert "--tls-ca" in flags[client], client
    assert {"--ssl-certfile", "--ssl-keyfile"} <= set(flags["gateway"])
    # The name every drafter certificate carries, which deploy/make-secrets.sh puts in it.
    assert flags["verifier"]["--tls-server-name"] == "specd-drafter"
    assert "specd-drafter" in (ROOT / "deploy" / "make-secrets.sh").read_text()
    # Healthchecks: compose.yaml's, over TLS against the CA (the gateway's URL over https).
    for name, svc in services.items():
        if "healthcheck" in svc:
            test = [a.replace("http://", "https://") for a in base[name]["healthcheck"]["test"]]
            assert svc["healthcheck"]["test"] == test + ["/run/secrets/specd-tls-ca"], name
            assert "specd-tls-ca" in svc["secrets"], name
    assert set(services) - {"prometheus"} <= {n for n, s in services.items() if "healthcheck" in s}
    # Prometheus: deploy/prometheus.yml but the gateway over HTTPS, checked against the CA.
    assert services["prometheus"]["volumes"] == ["./deploy/prometheus-secure.yml:/etc/specd/prometheus.yml:ro"]
    plain = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    tls = yaml.safe_load((ROOT / "deploy" / "prometheus-secure.yml").read_text())
    plain["scrape_configs"][0].update(scheme="https", tls_config={"ca_file": "/run/secrets/specd-tls-ca"})
    assert plain["scrape_configs"][0]["job_name"] == "gateway" and tls == plain


def test_make_secrets_serve_grpc_tls(tmp_path):
    """deploy/make-secrets.sh's files: a certificate the CA signed, for the names the stack calls,
    that gRPC serves and deploy/docker/healthcheck.py (the containers' healthcheck) accepts."""
    import grpc
    from concurrent import futures
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    d = make_secrets(tmp_path / "s")
    assert stat.S_IMODE(d.stat().st_mode) == 0o700 and (d / ".gitignore").read_text() == "*\n"
    assert stat.S_IMODE((d / "ca.key").stat().st_mode) == 0o600
    before = {f: (d / f).read_bytes() for f in ("auth-token", "ca.crt", "tls.crt", "tls.key")}
    assert len(before["auth-token"].strip()) == 64  # 256 bits, hex
    make_secrets(d)  # a second run keeps what exists
    assert before == {f: (d / f).read_bytes() for f in before}

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    security = auth.Security(tls_cert=str(d / "tls.crt"), tls_key=str(d / "tls.key"))
    tls_port = server.add_secure_port("127.0.0.1:0", auth.server_credentials(security))
    server.add_secure_port(f"127.0.0.2:{tls_port}", auth.server_credentials(security))  # a name not in the cert
    plain_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        check = [sys.executable, str(ROOT / "deploy" / "docker" / "healthcheck.py"), "grpc"]
        assert subprocess.run([*check, f"127.0.0.1:{tls_port}", str(d / "ca.crt")]).returncode == 0
        assert subprocess.run([*check, f"127.0.0.1:{tls_port}"], capture_output=True).returncode == 1
        assert subprocess.run([*check, f"127.0.0.1:{plain_port}"]).returncode == 0
        # The swap's own check, where the old container has no healthcheck: plaintext only.
        fallback = health_command(None, plain_port)
        assert subprocess.run([sys.executable, *fallback[1:]], capture_output=True).returncode == 0

        def serving(address, server_name):
            ca = auth.Security(tls_ca=str(d / "ca.crt"), tls_server_name=server_name)
            with auth.sync_channel(address, ca, auth.DRAFTER) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            return reply.status == health_pb2.HealthCheckResponse.SERVING

        # The verifier reaches a swapped-in drafter by a container name the certificate cannot
        # list, checking the name every drafter's certificate carries instead.
        assert serving(f"localhost:{tls_port}", None) and serving(f"127.0.0.2:{tls_port}", "specd-drafter")
        for address, name in ((f"127.0.0.2:{tls_port}", None), (f"127.0.0.1:{tls_port}", "specdtest-drafter-dm-2")):
            with pytest.raises(grpc.RpcError) as e:
                serving(address, name)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, (address, name)
    finally:
        server.stop(None)


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


def test_swap_carries_secrets_health_and_trust():
    # Compose file secrets are bind mounts under /run/secrets/; nothing else travels.
    mounts = [{"Type": "bind", "Source": "/h/auth-token", "Destination": "/run/secrets/specd-auth-token", "RW": False},
              {"Type": "volume", "Name": "v", "Source": "/var/lib/docker/volumes/v", "Destination": "/run/secrets/v"},
              {"Type": "bind", "Source": "/h/models", "Destination": "/models", "RW": True}]
    assert secret_volumes(mounts) == {"/h/auth-token": {"bind": "/run/secrets/specd-auth-token", "mode": "ro"}}
    assert secret_volumes([]) == {}
    tls = ["CMD", "python", "/opt/specd/healthcheck.py", "grpc", "127.0.0.1:50061", "/run/secrets/specd-tls-ca"]
    assert health_command({"Test": tls, "Interval": 5_000_000_000}, 50061) == tls[1:]
    assert health_command({"Test": ["CMD-SHELL", "exit 0"]}, 1) == ["/bin/sh", "-c", "exit 0"]
    for none in (None, {}, {"Test": ["NONE"]}):
        cmd = health_command(none, 50077)
        assert cmd[:2] == ["python", "-c"] and "127.0.0.1:50077" in cmd[2]
    for trusted in (True, False):
        request = register_request(pb.DrafterStatus(name="dm", address="drafter-dm:50061", trusted=trusted),
                                   "dm-2", "p-drafter-dm-2:50061")
        assert (request.name, request.address, request.trusted) == ("dm-2", "p-drafter-dm-2:50061", trusted)


@pytest.mark.docker
def test_cpu_build_without_the_wheel_stops_at_once(request, tmp_path):
    """A real image build of the deps stage with an empty wheels/: it stops at the torch step,
    before pip runs, with the command that fills wheels/ (no CUDA torch download)."""
    docker, client = docker_client(request)
    base = os.environ.get("SPECD_BASE_IMAGE") or "specd-base:bookworm"
    try:
        client.images.get(base)
    except docker.errors.ImageNotFound:
        pytest.skip(f"{base} is not built (deploy/build-base-image.sh)")
    ctx = tmp_path / "ctx"
    shutil.copytree(ROOT / "deploy" / "docker", ctx / "deploy" / "docker")
    shutil.copy(ROOT / "pyproject.toml", ctx)
    shutil.copy(DOCKERFILE, ctx / "Dockerfile")
    (ctx / "wheels").mkdir()
    (ctx / "wheels" / "README.md").write_text("empty\n")
    t0 = time.monotonic()
    with pytest.raises(docker.errors.BuildError) as e:
        client.images.build(path=str(ctx), target="deps", buildargs={"BASE_IMAGE": base}, rm=True, forcerm=True,
                            nocache=True)
    took = time.monotonic() - t0
    log = re.sub(r"\x1b\[[0-9;]*m", "", "".join(c.get("stream", "") + c.get("error", "") for c in e.value.build_log))
    report(f"CPU build without the wheel stopped after {took:.1f} s: {str(e.value).strip()[:200]}\n"
           + "\n".join(line for line in log.splitlines() if line.startswith(("error:", "  pip download", "or copy"))))
    assert "error: TORCH_VARIANT=cpu, but wheels/ in the build context has no torch-" in log
    assert "pip download torch==" in log and "Downloading" not in log and "Collecting" not in log
    assert took < 120


# ---------------------------------------------------------------- the stack


@pytest.fixture(scope="module")
def stack(request):
    yield from start_stack(request, [COMPOSE_FILE], PROFILES)


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
def test_serves_bfloat16_on_the_prebuilt_cpu_ops(stack):
    """The images carry the fused CPU ops compiled at build time (no compiler in them), so the
    verifier's `auto` is bfloat16 on an AVX2 or AVX-512 CPU, as `specd up`'s on the host."""
    from specd.kernels import cpu_ops

    if not cpu_ops.cpu_supported():
        pytest.skip("this CPU runs neither build of the fused ops")
    assert openai_client(stack).models.list().data[0].model_extra["dtype"] == "bfloat16"


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


GRAFANA = "grafana/grafana:11.6.0"  # compose.yaml's; Docker Hub, unreachable where this was written


@pytest.mark.docker
def test_unpullable_profile_fails_alone(stack):
    """The stack came up (`--profile ngram`) without Grafana's image; a `--profile monitoring up`
    that cannot pull it fails, and what runs keeps running, untouched."""
    import docker

    assert yaml_service("grafana")["image"] == GRAFANA
    try:
        stack.client.images.get(GRAFANA)
        pytest.skip(f"{GRAFANA} is present here: its pull cannot fail")
    except docker.errors.ImageNotFound:
        pass
    before = {c.name: c.id for c in stack.containers()}
    t0 = time.monotonic()
    out = stack.run("--profile", "monitoring", "up", "-d", check=False, timeout=600)
    report(f"`--profile monitoring up -d` without {GRAFANA}: exit {out.returncode} in {time.monotonic() - t0:.1f} s: "
           f"{(out.stderr.strip().splitlines() or [''])[-1]}")
    assert out.returncode != 0
    assert {c.name: c.id for c in stack.containers()} == before  # nothing created, recreated or removed
    assert all((c.attrs["State"].get("Health") or {}).get("Status") == "healthy" for c in stack.containers())
    text, spec = complete(openai_client(stack), PROMPTS[3], drafter="ng", num_speculative_tokens=4)
    assert text and spec["draft_tokens"] >= 0


def yaml_service(name: str) -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load(COMPOSE_FILE.read_text())["services"][name]


@pytest.mark.docker
@pytest.mark.timeout(1200)
def test_swap_drafter_container_under_load(stack):
    client = openai_client(stack)
    t0 = time.monotonic()
    reference = offline_reference(PROMPTS, client)
    report(f"offline reference: {len(PROMPTS)} greedy completions in {time.monotonic() - t0:.1f} s")
    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        plain = [t for t, _ in ex.map(lambda p: complete(client, p, num_speculative_tokens=0), PROMPTS)]
    assert plain == reference  # the stack without speculation, before the swap
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
    text, spec = complete(client, PROMPTS[1], drafter="dm-2", num_speculative_tokens=4)  # a k: adaptive may pick 0
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
    text, spec = complete(openai_client(stack), PROMPTS[2], drafter="dm-2", num_speculative_tokens=4)
    assert text and spec["draft_tokens"] > 0
