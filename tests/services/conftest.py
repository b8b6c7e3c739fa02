"""Real service processes on loopback ports for the services tests.

`launcher` starts `specd <service> ...` as a child process (one torch thread each: the
machine is shared), waits until it is healthy, and stops everything at teardown. Logs go
to files under the test's tmp dir and are printed when a process fails to come up.
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from specd.cli.readiness import grpc_serving, http_ok

STARTUP_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    def __init__(self, name: str, proc: subprocess.Popen, address: str, log: Path, argv: list[str]):
        self.name, self.proc, self.address, self.log, self.argv = name, proc, address, log, argv

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class Launcher:
    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.services: list[Service] = []

    free_port = staticmethod(free_port)

    def start(self, name: str, command: str, args: list[str], port: int | None = None,
              http: bool = False, wait: bool = True) -> Service:
        port = port or free_port()
        argv = [sys.executable, "-m", "specd.cli", command, "--port", str(port), *args]
        if command in ("verifier", "drafter") and "--metrics-port" not in args:
            argv += ["--metrics-port", "0"]
        if command in ("verifier", "drafter") and "--threads" not in args:
            argv += ["--threads", "1"]
        log = self.log_dir / f"{name}-{len(self.services)}.log"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        with open(log, "w") as f:
            proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        service = Service(name, proc, f"127.0.0.1:{port}", log, argv)
        self.services.append(service)
        if wait:
            self.wait_healthy(service, http)
        return service

    def wait_healthy(self, service: Service, http: bool = False) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        check = (lambda: http_ok(f"http://{service.address}/health")) if http else (lambda: grpc_serving(service.address))
        while not check():
            if service.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{service.name} did not come up:\n{service.log_text()[-3000:]}")
            time.sleep(0.2)

    def stop(self, service: Service, sig: int = signal.SIGTERM) -> None:
        if service.proc.poll() is None:
            service.proc.send_signal(sig)
            try:
                service.proc.wait(15)
            except subprocess.TimeoutExpired:
                service.proc.kill()
                service.proc.wait()

    def stop_all(self) -> None:
        for service in reversed(self.services):
            self.stop(service)


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    launcher = Launcher(tmp_path_factory.mktemp("services"))
    yield launcher
    launcher.stop_all()


@pytest.fixture
def loop():
    """An event loop in a thread: drafter servers and a verifier's pool live there, the engine in the test's."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
