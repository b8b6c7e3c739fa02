"""`specd up` brings the whole stack up on loopback, and `specd drafters` manages its pool;
SIGTERM stops every process."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specd.models.demo_paths import demo_model_dir
from specd.sampling import SamplingParams

MODEL = "specd-demo-target"


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _specd(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specd.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def up(launcher):
    ports = {name: launcher.free_port() for name in ("http", "verifier", "drafter")}
    # metrics ports default to gRPC port + 1000: make sure those are free too
    while ports["verifier"] > 64535 or _port_open(ports["verifier"] + 1000):
        ports["verifier"] = launcher.free_port()
    # drafter ports count up from --drafter-port: make sure the second one is free too
    while ports["drafter"] > 64534 or any(_port_open(ports["drafter"] + d) for d in (1, 1000, 1001)):
        ports["drafter"] = launcher.free_port()
    # The demo pair keeps this test fast; the default (real) pair is tested in tests/real/.
    proc = subprocess.Popen([sys.executable, "-m", "specd.cli", "up", "--port", str(ports["http"]),
                             "--verifier-port", str(ports["verifier"]), "--drafter-port", str(ports["drafter"]),
                             "--target", str(demo_model_dir("target")),
                             "--drafter", f"draft_model:{demo_model_dir('drafter')}", "--drafter", "ngram"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    line = proc.stdout.readline()  # blocks until the stack is healthy (or it gave up)
    if "specd is up" not in line:
        proc.kill()
        pytest.fail(f"specd up did not come up: {line!r}\n{proc.stderr.read()[-3000:]}")
    metrics_line = proc.stdout.readline()
    yield dict(proc=proc, ports=ports, line=line, metrics_line=metrics_line)
    if proc.poll() is None:
        proc.kill()


def test_up_serves_the_demo_pair_with_speculation(up):
    assert f"http://127.0.0.1:{up['ports']['http']}/v1" in up["line"]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{up['ports']['http']}/v1", api_key="x", max_retries=0)
    from specd.llm import LLM

    prompt = "def fibonacci(n):\n    "
    (ref,) = LLM(str(demo_model_dir("target"))).generate([prompt], SamplingParams(temperature=0, max_tokens=32))
    # A fresh stack's drafters read a first history in the background (their speed unknown) and draft
    # from the step after they hold it: under load that can outlast a 32-token answer. After one
    # request the pool knows how fast they read, and the next request's history is read at once.
    client.completions.create(model=MODEL, prompt="warm up", max_tokens=8, temperature=0)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0)
    assert out.choices[0].text == ref.text
    assert out.usage.model_extra["speculative"]["draft_tokens"] > 0


def test_up_prints_where_every_service_serves_metrics(up):
    """Verifier and drafters on their gRPC port + 1000 (the services' default rule), the gateway
    on its HTTP port; every URL printed answers with parseable Prometheus text."""
    ports, line = up["ports"], up["metrics_line"]
    expected = {"gateway": f"http://127.0.0.1:{ports['http']}/metrics",
                "verifier": f"http://127.0.0.1:{ports['verifier'] + 1000}/metrics",
                "drafter draft_model": f"http://127.0.0.1:{ports['drafter'] + 1000}/metrics",
                "drafter ngram": f"http://127.0.0.1:{ports['drafter'] + 1001}/metrics"}
    assert line.startswith("metrics: "), line
    assert line.removeprefix("metrics: ").strip() == ", ".join(f"{n} {u}" for n, u in expected.items())
    families = {name: {f.name for f in text_string_to_metric_families(urllib.request.urlopen(url, timeout=10)
                                                                      .read().decode())}
                for name, url in expected.items()}
    assert "specd_verifier_kv_blocks_used" in families["verifier"]
    assert "specd_drafter_up" in families["drafter draft_model"] and "specd_drafter_up" in families["drafter ngram"]


def test_drafters_cli_lists_removes_and_adds(up, tmp_path):
    verifier = f"127.0.0.1:{up['ports']['verifier']}"
    listed = _specd("drafters", "--verifier", verifier, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    # The drafters `specd up` started hold its secret: trusted. Without it the verifier answers nothing.
    # The suffix index inside the verifier comes with the services named.
    assert [(r["name"], r["method"], r["healthy"], r["trusted"]) for r in rows] == [
        ("suffix", "suffix", True, True), ("draft_model", "draft_model", True, True), ("ngram", "ngram", True, True)]
    env = dict(os.environ, SPECD_CACHE=str(tmp_path))  # no token file there
    refused = subprocess.run([sys.executable, "-m", "specd.cli", "drafters", "--verifier", verifier, "list"],
                             capture_output=True, text=True, timeout=60, env=env)
    assert refused.returncode == 1 and refused.stderr.startswith("error: unauthenticated"), refused.stderr
    assert _specd("drafters", "--verifier", verifier, "remove", "ngram").returncode == 0
    names = [json.loads(line)["name"] for line in _specd("drafters", "--verifier", verifier, "list", "--json").stdout.splitlines()]
    assert names == ["suffix", "draft_model"]
    added = _specd("drafters", "--verifier", verifier, "add", "ngram-again", f"127.0.0.1:{up['ports']['drafter'] + 1}")
    assert added.returncode == 0 and json.loads(added.stdout)["healthy"] is True
    assert json.loads(added.stdout)["trusted"] is False  # added without --trusted
    table = _specd("drafters", "--verifier", verifier, "list").stdout
    assert "ngram-again" in table and "draft_model" in table
    missing = _specd("drafters", "--verifier", verifier, "remove", "nope")
    assert missing.returncode == 1 and missing.stderr.startswith("error: not_found: no drafter named 'nope'")


def _child(parent: int, role: str, port: int) -> int:
    """The pid of parent's child process running `specd <role> ... --port <port>` (from /proc)."""
    import pathlib

    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmd = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"specd.cli" in cmd and role.encode() in cmd and str(port).encode() in cmd:
            return int(stat.parent.name)
    raise LookupError(f"no `specd {role}` child of {parent}")


def test_a_killed_service_is_started_again(up):
    """SIGKILL the verifier, then a drafter: `specd up` starts each again on its port, and the
    stack serves the same greedy text afterwards."""
    from specd.cli.readiness import grpc_serving

    proc, ports = up["proc"], up["ports"]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports['http']}/v1", api_key="x", max_retries=0, timeout=120)
    before = client.completions.create(model=MODEL, prompt="import os\n", max_tokens=16, temperature=0).choices[0].text
    for role, port in (("verifier", ports["verifier"]), ("drafter", ports["drafter"])):
        victim = _child(proc.pid, role, port)
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while _child_or_none(proc.pid, role, port) in (None, victim) or not grpc_serving(f"127.0.0.1:{port}"):
            assert proc.poll() is None, "specd up went down"
            assert time.monotonic() < deadline, f"the {role} was not started again"
            time.sleep(0.5)
    deadline = time.monotonic() + 60
    while True:  # the gateway takes the new verifier back at its next health poll
        try:
            after = client.completions.create(model=MODEL, prompt="import os\n", max_tokens=16, temperature=0)
            break
        except openai.APIStatusError:
            assert time.monotonic() < deadline
            time.sleep(0.5)
    assert after.choices[0].text == before


def _child_or_none(parent: int, role: str, port: int) -> int | None:
    try:
        return _child(parent, role, port)
    except LookupError:
        return None


def test_sigterm_stops_every_process(up):
    proc, ports = up["proc"], up["ports"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    deadline = time.monotonic() + 10
    while any(_port_open(ports[p]) for p in ("http", "verifier")) or _port_open(ports["drafter"]):
        assert time.monotonic() < deadline, "a service still listens after specd up stopped"
        time.sleep(0.2)


def test_up_with_tls_serves_https_and_grpc_over_tls(launcher, tmp_path):
    import ssl

    import grpc
    import httpx
    from tls_certs import make_self_signed

    from specd.rpc import auth
    from specd.v1 import verifier_pb2 as pb
    from specd.v1 import verifier_pb2_grpc as pbg

    cert, key = make_self_signed(tmp_path)
    ports = {name: launcher.free_port() for name in ("http", "verifier", "drafter")}
    proc = subprocess.Popen([sys.executable, "-m", "specd.cli", "up", "--port", str(ports["http"]), "--verifier-port",
                             str(ports["verifier"]), "--drafter-port", str(ports["drafter"]), "--metrics-port", "0",
                             "--target", str(demo_model_dir("target")), "--drafter", "ngram",
                             "--tls-cert", cert, "--tls-key", key],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        line = proc.stdout.readline()
        assert f"specd is up: https://127.0.0.1:{ports['http']}/v1" in line, proc.stderr.read()[-3000:]
        client = openai.OpenAI(base_url=f"https://127.0.0.1:{ports['http']}/v1", api_key="x", max_retries=0,
                               http_client=httpx.Client(verify=ssl.create_default_context(cafile=cert)))
        out = client.completions.create(model=MODEL, prompt="x = 1\nx = 1\nx = 1\nx", max_tokens=8, temperature=0)
        assert out.usage.completion_tokens == 8
        verifier = f"127.0.0.1:{ports['verifier']}"
        secret = auth.read_secret(str(auth.up_token_file(verifier)))
        stub = pbg.VerifierStub(auth.sync_channel(verifier, auth.Security(secret=secret, tls_ca=cert), auth.VERIFIER))
        drafters = {d.name: d for d in stub.ListDrafters(pb.ListDraftersRequest(), timeout=30).drafters}
        # the ngram service reached over TLS, trusted; the suffix index inside the verifier beside it
        assert set(drafters) == {"ngram", "suffix"} and drafters["suffix"].address == "in-process"
        assert drafters["ngram"].healthy and drafters["ngram"].trusted
        plain = pbg.VerifierStub(auth.sync_channel(verifier, auth.Security(secret=secret), auth.VERIFIER))
        with pytest.raises(grpc.RpcError):
            plain.Info(pb.InfoRequest(), timeout=5)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_drafter_flags_take_a_model_or_options():
    from specd.cli.up import parse_drafter

    assert parse_drafter("draft_model:/models/d") == ("draft_model", "/models/d")
    assert parse_drafter('suffix:{"suffix_decoding_max_cached_requests": 0}') == (
        "suffix", '{"suffix_decoding_max_cached_requests": 0}')
    assert parse_drafter("ngram") == ("ngram", None)
    for bad, why in (("suffix:/models/d", "JSON options"), ("ngram:[1]", "JSON options"), ("medusa", "unknown method")):
        with pytest.raises(ValueError, match=why):
            parse_drafter(bad)
