"""The gateway under abuse (issue 70, item 4), over real HTTP on loopback: idle and slowloris
connections are closed at --header-timeout and those past --max-connections get 503, a 100 MB body
gets 413 without being read, a trickled body 408, a prompt of 10x max_model_len and max_tokens of
10^9 get 400, and 1,000 concurrent streams are shed with 429 and Retry-After; the gateway's RSS stays
bounded throughout and every refusal is counted in specd_gateway_rejected_total by reason.

Sizes: 1,000 idle sockets and 110 more past the connection limit, 20 slowloris ones (a header byte
every 0.5 s), 1,000 streams: on the 2-core VM the module takes about a minute, most of it starting
the verifier and the gateway.
"""
from __future__ import annotations

import asyncio
import json
import resource
import select
import socket
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specd.models.demo_paths import demo_model_dir

TARGET = demo_model_dir("target")
HEADER_TIMEOUT_S = 4.0
BODY_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 1100
MAX_CONCURRENT = 64
IDLE = 1000
SLOW = 20
STREAMS = 1000
MB = 1 << 20

pytestmark = pytest.mark.skipif(not (TARGET / "config.json").is_file(), reason="the bundled demo target is missing")


@pytest.fixture(scope="module")
def stack(launcher):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = IDLE + 400 + 256
    if soft < want:  # this process holds the sockets
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"the open-file limit ({hard}) is below the {want} sockets this test opens")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    verifier = launcher.start("verifier", "verifier", ["--model", str(TARGET), "--max-num-seqs", "4",
                                                       "--max-queued-requests", "8", "--log-level", "warning"])
    gateway = launcher.start("gateway", "gateway", [
        "--verifier", verifier.address, "--log-level", "warning", "--header-timeout", str(HEADER_TIMEOUT_S),
        "--body-timeout", str(BODY_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS),
        "--max-concurrent-requests", str(MAX_CONCURRENT)], http=True)
    host, port = gateway.address.split(":")
    return dict(gateway=gateway, base=f"http://{gateway.address}", addr=(host, int(port)))


def _rss_mb(stack) -> float:
    status = open(f"/proc/{stack['gateway'].proc.pid}/status").read()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) / 1024


def _metrics(stack) -> dict[tuple[str, str], float]:
    """(sample name, reason label or "") -> value, of the gateway's rejections and connections."""
    text = httpx.get(f"{stack['base']}/metrics", timeout=30).text
    return {(s.name, s.labels.get("reason", "")): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name in ("specd_gateway_rejected_total", "specd_gateway_http_connections")}


def _rejected(before: dict, after: dict, reason: str) -> float:
    key = ("specd_gateway_rejected_total", reason)
    return after.get(key, 0) - before.get(key, 0)


def _complete(stack, **body) -> httpx.Response:
    return httpx.post(f"{stack['base']}/v1/completions", timeout=60,
                      json={"prompt": "def f", "max_tokens": 4, "temperature": 0, **body})


def _closed(sock: socket.socket) -> bool:
    """Whether the server closed it (EOF or reset); the socket is non-blocking."""
    try:
        return sock.recv(1 << 16) == b""
    except BlockingIOError:
        return False
    except ConnectionError:
        return True


def _head(data: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def test_idle_and_slow_connections_are_closed_and_the_excess_gets_503(stack):
    before, rss0 = _metrics(stack), _rss_mb(stack)
    opened = time.monotonic()
    idle = [socket.create_connection(stack["addr"]) for _ in range(IDLE)]
    slow = [socket.create_connection(stack["addr"]) for _ in range(SLOW)]
    for s in slow:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    # Served meanwhile, and the connections are counted.
    assert httpx.get(f"{stack['base']}/health", timeout=10).status_code == 200
    assert _complete(stack).status_code == 200
    assert _metrics(stack)[("specd_gateway_http_connections", "")] >= IDLE + SLOW
    rss_open = _rss_mb(stack)
    # Past --max-connections: a request is answered 503 with Retry-After.
    excess = [socket.create_connection(stack["addr"]) for _ in range(MAX_CONNECTIONS - IDLE - SLOW + 30)]
    refused = _complete(stack)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "too_many_connections", refused.text
    assert int(refused.headers["retry-after"]) >= 1
    assert time.monotonic() - opened < HEADER_TIMEOUT_S, "too slow to test the connection limit: raise the timeout"
    sockets = idle + slow + excess
    for s in sockets:
        s.setblocking(False)
    open_ = set(range(len(sockets)))
    while open_ and time.monotonic() - opened < HEADER_TIMEOUT_S + 5:
        for s in slow:  # a header byte every 0.5 s: never a complete request
            try:
                s.send(b"a")
            except OSError:
                pass
        time.sleep(0.5)
        open_ = {i for i in open_ if not _closed(sockets[i])}
    closed_after = time.monotonic() - opened
    for s in sockets:
        s.close()
    assert not open_, f"{len(open_)} idle or slow connections still open {closed_after:.1f} s after opening"
    assert _complete(stack).status_code == 200  # serving again
    after = _metrics(stack)
    assert _rejected(before, after, "header_timeout") >= len(sockets)
    assert _rejected(before, after, "too_many_connections") == 1
    growth = rss_open - rss0
    print(f"\n{len(sockets)} connections: gateway RSS {rss0:.0f} -> {rss_open:.0f} MB with {IDLE + SLOW} open, "
          f"{_rss_mb(stack):.0f} MB after; all closed {closed_after:.1f} s after opening")
    assert growth < 64, growth  # a few KB a connection


def _send_until_answered(stack, head: bytes, pieces, total: int) -> tuple[int, dict, bytes, int]:
    """Sends head, then the pieces until the response starts; returns the response's status, headers
    and body (read to the server's close) and how many body bytes were sent."""
    sock = socket.create_connection(stack["addr"])
    sock.sendall(head)
    sock.setblocking(False)
    sent, answered = 0, False
    try:
        for piece in pieces:
            view = memoryview(piece)
            while view and not answered:
                readable, writable, _ = select.select([sock], [sock], [], 10)
                answered = bool(readable) or not writable  # answered, or stuck for 10 s
                if not answered:
                    n = sock.send(view)
                    sent, view = sent + n, view[n:]
            if answered:
                break
    except (BrokenPipeError, ConnectionResetError):
        pass
    sock.setblocking(True)
    sock.settimeout(10)
    response = b""
    try:
        while chunk := sock.recv(1 << 16):
            response += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    sock.close()
    assert response, f"no response after {sent} of {total} bytes"
    return (*_head(response), sent)


def test_a_100mb_body_is_refused_413_unread(stack):
    before, rss0 = _metrics(stack), _rss_mb(stack)
    piece = b" " * MB
    total = 100 * MB
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % total)
    status, headers, body, sent = _send_until_answered(stack, head, (piece for _ in range(100)), total)
    assert status == 413 and json.loads(body)["error"]["type"] == "invalid_request_error"
    assert headers["connection"] == "close" and sent < 20 * MB, sent  # refused on its Content-Length alone
    # Chunked, with no length to go by: refused once past --max-body-bytes (4 MB), the rest unread.
    chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n")
    status, headers, body, sent_chunked = _send_until_answered(
        stack, chunked, (b"%x\r\n%s\r\n" % (MB, piece) for _ in range(100)), total)
    assert status == 413 and headers["connection"] == "close" and sent_chunked < 40 * MB, sent_chunked
    growth = _rss_mb(stack) - rss0
    print(f"\n100 MB bodies: {sent / MB:.1f} MB sent before the 413 (Content-Length), {sent_chunked / MB:.1f} MB "
          f"(chunked); gateway RSS +{growth:.1f} MB")
    assert growth < 32, growth
    assert _rejected(before, _metrics(stack), "body_too_large") == 2


def test_a_trickled_body_gets_408(stack):
    before = _metrics(stack)
    sock = socket.create_connection(stack["addr"])
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"prompt\": ")
    t0 = time.monotonic()
    sock.settimeout(BODY_TIMEOUT_S + 10)
    response = b""
    while chunk := sock.recv(1 << 16):
        response += chunk
    waited = time.monotonic() - t0
    sock.close()
    status, headers, body = _head(response)
    assert status == 408 and json.loads(body)["error"]["code"] == "body_timeout", response
    assert BODY_TIMEOUT_S - 0.5 < waited < BODY_TIMEOUT_S + 5, waited
    assert _rejected(before, _metrics(stack), "body_timeout") == 1


def test_a_prompt_past_the_context_and_max_tokens_of_1e9_get_400(stack):
    model = httpx.get(f"{stack['base']}/v1/models", timeout=30).json()["data"][0]
    max_len = model["max_model_len"]
    cases = [
        ("prompt", {"prompt": "hello " * (10 * max_len)}),  # about 10x max_model_len tokens of text
        ("prompt", {"prompt": [7] * (10 * max_len)}),  # token ids
        ("prompt", {"prompt": "x" * (4 * MB - 1000)}),  # near the body limit: refused by its size, untokenized
        ("max_tokens", {"max_tokens": 10**9}),  # refused as vLLM refuses it, not clamped
        ("max_tokens", {"max_tokens": 10**30}),  # past any integer type downstream
    ]
    for param, body in cases:
        t0 = time.monotonic()
        r = _complete(stack, **body)
        elapsed = time.monotonic() - t0
        assert r.status_code == 400, (param, r.text[:300])
        error = r.json()["error"]
        assert error["param"] == param and "maximum context length" in error["message"], error
        assert elapsed < 5, (param, elapsed)
    chat = httpx.post(f"{stack['base']}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hello " * (10 * max_len)}], "max_tokens": 4})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages", chat.text[:300]
    assert _complete(stack).status_code == 200


async def _raw_stream(addr, index: int) -> tuple[int, dict, bytes]:
    body = json.dumps({"prompt": f"item {index}:", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                       "stream": True}).encode()
    reader, writer = await asyncio.open_connection(*addr)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    data = await reader.read()  # to the server's close
    writer.close()
    return _head(data)


def test_1000_concurrent_streams_are_shed_with_429(stack):
    before, rss0 = _metrics(stack), _rss_mb(stack)
    peak = [rss0]
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.1):
            peak[0] = max(peak[0], _rss_mb(stack))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()

    async def burst():
        return await asyncio.gather(*(_raw_stream(stack["addr"], i) for i in range(STREAMS)))

    t0 = time.monotonic()
    try:
        results = asyncio.run(asyncio.wait_for(burst(), 120))
    finally:
        done.set()
        watcher.join()
    elapsed = time.monotonic() - t0
    statuses = [status for status, _, _ in results]
    ok = [body for status, _, body in results if status == 200]
    shed = [(headers, body) for status, headers, body in results if status == 429]
    assert len(ok) + len(shed) == STREAMS, sorted(set(statuses))
    assert ok and shed
    for body in ok:  # chunked SSE, whole: its finish and [DONE]
        assert b'"finish_reason":"length"' in body and b"data: [DONE]" in body
    for headers, body in shed:
        assert int(headers["retry-after"]) >= 1
        assert b'"rate_limit_error"' in body
    after = _metrics(stack)
    gateway_shed = _rejected(before, after, "overloaded")
    verifier_shed = _rejected(before, after, "verifier_overloaded")
    print(f"\n{STREAMS} streams in {elapsed:.1f} s: {len(ok)} served, {gateway_shed:.0f} shed by the gateway, "
          f"{verifier_shed:.0f} by the verifier's queue; gateway RSS {rss0:.0f} MB, peak {peak[0]:.0f} MB")
    assert gateway_shed > 0 and gateway_shed + verifier_shed == len(shed)
    assert peak[0] - rss0 < 128, (rss0, peak[0])
    assert _complete(stack).status_code == 200
