"""Metrics ports of services on one host (specd.rpc.metrics_port): by default each gRPC service
serves /metrics on its own port + 1000, so two drafters never collide; a busy metrics port
stops a service at start with one line naming the port and the flag.

Real `specd drafter` processes (ngram and suffix: no model to load) and a verifier on the
demo target, scraped over HTTP and parsed with prometheus_client's parser.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from argparse import Namespace
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specd.models.demo_paths import demo_model_dir
from specd.rpc.metrics_port import METRICS_PORT_OFFSET, default_metrics_port
from specd.cli.ports import metrics_ports
from specd.cli.readiness import grpc_serving

STARTUP_TIMEOUT_S = 120.0
URL_RE = re.compile(r"metrics at (http://127\.0\.0\.1:(\d+)/metrics)")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port(low: int = 0, high: int = 0) -> int:
    """A free port; with low/high, one in [low, high] (scanned)."""
    if not low:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    for port in range(low, high + 1):
        if _bindable(port):
            return port
    pytest.skip(f"no free port in [{low}, {high}]")


def _grpc_port_with_free_metrics(taken: set[int]) -> int:
    """A free gRPC port whose default metrics port (+1000) is free too."""
    for _ in range(100):
        port = _free_port()
        if port + METRICS_PORT_OFFSET <= 65535 and _bindable(port + METRICS_PORT_OFFSET) \
                and not {port, port + METRICS_PORT_OFFSET} & taken:
            taken |= {port, port + METRICS_PORT_OFFSET}
            return port
    pytest.skip("no free gRPC port with a free port 1000 above it")


def _drafter(tmp_path: Path, method: str, port: int, *extra: str) -> tuple[subprocess.Popen, Path]:
    return _service(tmp_path, "drafter", port, "--method", method, *extra)


def _service(tmp_path: Path, command: str, port: int, *extra: str) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / f"{command}-{port}.log"
    argv = [sys.executable, "-m", "specd.cli", command, "--port", str(port), "--threads", "1", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=f, env=env, start_new_session=True)
    return proc, log


def _wait_serving(proc: subprocess.Popen, log: Path, port: int) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not grpc_serving(f"127.0.0.1:{port}"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"drafter on {port} did not come up:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _scrape(url: str) -> dict[str, list]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _logged_url(log: Path) -> tuple[str, int]:
    found = URL_RE.findall(log.read_text())
    assert len(found) == 1, f"expected one 'metrics at URL' line:\n{log.read_text()[-3000:]}"
    url, port = found[0]
    return url, int(port)


@pytest.fixture()
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        _stop(proc)


def test_two_drafters_on_one_host_serve_metrics_on_different_default_ports(tmp_path, procs):
    taken: set[int] = set()
    ports = {method: _grpc_port_with_free_metrics(taken) for method in ("ngram", "suffix")}
    started = {method: _drafter(tmp_path, method, port) for method, port in ports.items()}
    procs.extend(p for p, _ in started.values())
    seen = set()
    for method, (proc, log) in started.items():
        _wait_serving(proc, log, ports[method])
        url, metrics_port = _logged_url(log)
        assert metrics_port == ports[method] + METRICS_PORT_OFFSET
        samples = _scrape(url)
        # the drafter's own registry: its up gauge, labelled with its name (the method by default)
        (up,) = samples["specd_drafter_up"]
        assert up.labels == {"drafter": method} and up.value == 1.0
        assert "specd_drafter_propose_batches" in samples
        seen.add(metrics_port)
    assert len(seen) == 2
    for proc, _ in started.values():
        assert proc.poll() is None, "a drafter died while the other started"


@pytest.mark.skipif(not (demo_model_dir("target") / "config.json").is_file(), reason="the bundled demo target is missing")
def test_verifier_follows_the_same_rule(tmp_path, procs):
    port = _grpc_port_with_free_metrics(set())
    proc, log = _service(tmp_path, "verifier", port, "--no-speculation")
    procs.append(proc)
    _wait_serving(proc, log, port)
    url, metrics_port = _logged_url(log)
    assert metrics_port == port + METRICS_PORT_OFFSET
    assert "specd_verifier_kv_blocks_used" in _scrape(url)


def test_default_metrics_port_past_65535_is_picked_by_the_os(tmp_path, procs):
    port = _free_port(65535 - METRICS_PORT_OFFSET + 1, 65535)
    assert default_metrics_port(port) == 0
    proc, log = _drafter(tmp_path, "ngram", port)
    procs.append(proc)
    _wait_serving(proc, log, port)
    url, metrics_port = _logged_url(log)
    assert metrics_port not in (0, port)
    assert _scrape(url)["specd_drafter_up"][0].value == 1.0


@pytest.mark.parametrize("explicit", [True, False], ids=["flag", "default"])
def test_busy_metrics_port_fails_at_start_with_one_line(tmp_path, procs, explicit):
    taken: set[int] = set()
    grpc_port = _grpc_port_with_free_metrics(taken)
    with socket.socket() as holder:
        busy = _free_port() if explicit else grpc_port + METRICS_PORT_OFFSET
        holder.bind(("127.0.0.1", busy))
        holder.listen()
        proc, log = _drafter(tmp_path, "ngram", grpc_port, *(["--metrics-port", str(busy)] if explicit else []))
        procs.append(proc)
        try:
            rc = proc.wait(STARTUP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"drafter did not exit with metrics port {busy} busy:\n{log.read_text()[-3000:]}")
    text = log.read_text()
    assert rc != 0
    assert "Traceback" not in text, text
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, text
    assert str(busy) in errors[0] and "--metrics-port" in errors[0], errors[0]
    assert not grpc_serving(f"127.0.0.1:{grpc_port}")


def _up_args(**kw) -> Namespace:
    return Namespace(**{"metrics_port": None, "verifier_port": 50051, "drafter_port": 50061, **kw})


def test_up_metrics_ports_follow_each_services_rule():
    verifier, drafters = metrics_ports(_up_args(), 2)
    assert (verifier, drafters) == (51051, [51061, 51062])
    # a second stack on other gRPC ports: no metrics port shared with the first
    verifier2, drafters2 = metrics_ports(_up_args(verifier_port=50151, drafter_port=50161), 2)
    assert not {verifier, *drafters} & {verifier2, *drafters2}
    assert metrics_ports(_up_args(metrics_port=9401), 2) == (9401, [9402, 9403])
    assert metrics_ports(_up_args(metrics_port=0), 2) == (0, [0, 0])
    # past 65535: a free port picked by `specd up` itself, so it can print it
    verifier, (drafter,) = metrics_ports(_up_args(verifier_port=65000, drafter_port=65001), 1)
    assert verifier > 0 and drafter > 0 and verifier != drafter
