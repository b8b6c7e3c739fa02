"""Hours, not minutes: `specd up --replicas 2` under mixed traffic and faults, with figures per window.

    python bench/soak.py --minutes 60 --out bench/results/soak_epyc      # the result
    python bench/soak.py --minutes 6 --window 2                           # a quick look

The stack: `specd up --replicas 2` with its default drafters (the trained draft model as a service,
the suffix index in each replica), one torch thread per replica (2 cores), an admin key and a shared
secret, nothing else. Traffic (one client thread per stream, concurrency stepping 1, 4, 8, 16, 32 and
back, a step a minute): streamed and not; clients that close a stream after a few chunks; JSON-schema and
regex requests; a 600-token system prompt shared by a third of the requests (the prefix cache); greedy and
sampled (T 0.7). Faults:
- every --swap-every minutes a drafter swap through the admin API: a new `specd drafter --method
  draft_model` registered on both replicas, the previous swapped-in one removed with drain, then stopped;
- every --kill-drafter-every minutes the swapped-in drafter service SIGKILLed and started again on its port;
- every --kill-replica-every minutes one verifier replica SIGKILLed (they alternate); `specd up` starts it again.
Measured per --window minutes and in total: requests sent, completed, closed on purpose, failed (each with
its status and message, and whether it was in flight on a replica killed at that moment: the only failures
allowed); greedy answers of 8 fixed prompts against their k = 0 text taken before the faults (0 may
change); RSS and open file descriptors (sockets: the gRPC channels and HTTP connections) of every
process, and of it the KV caches' resident bytes (specd_kv_cache_resident_bytes: the services take
their caches' pages at start, so this holds still; with --lazy-kv-cache RSS would climb towards the
caches' size as traffic cycles through the blocks, and the growth outside them is what a leak would
show), and each drafter's sequences kept (specd_drafter_sequences); free KV blocks of
each replica when idle, at the start and at the end; p50/p99 TTFT and inter-token latency.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info, machine_line, write_result  # noqa: E402
from real_pair_http import free_port  # noqa: E402

SYSTEM = ("You are a careful assistant for a hardware store. " * 60).strip()  # ~600 tokens, shared
QUESTIONS = ["What is the capital of France?", "Explain what a hash map is.", "Write a haiku about rain.",
             "How do I sort a list in Python?", "Name three primary colors.", "What does HTTP stand for?",
             "Give me a tip for learning to cook.", "Why is the sky blue?"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
CONCURRENCY = [1, 4, 8, 16, 32]  # a step a minute: every 5-minute window holds the same mix


def gauges(pid: int) -> dict[str, float]:
    """From the process's /metrics (its --metrics-port): its KV caches' resident bytes
    (specd_kv_cache_resident_bytes) and, for a drafter, the sequences it keeps state for
    (specd_drafter_sequences); {} where it serves none."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        port = int(cmd[cmd.index("--metrics-port") + 1])
        if port == 0:
            return {}
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    except (OSError, ValueError, IndexError):
        return {}
    out = {}
    for key, name in (("kv", "specd_kv_cache_resident_bytes"), ("sequences", "specd_drafter_sequences")):
        found = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
        if found:
            out[key] = float(found.group(1))
    return out


class Soak:
    def __init__(self, args):
        self.args, self.t0 = args, time.monotonic()
        self.port, self.vport, self.dport = free_port(), free_port(), free_port()
        while any(self._open(p) for p in (self.vport + 1, self.dport + 1)):
            self.vport, self.dport = free_port(), free_port()
        self.admin = secrets.token_urlsafe(16)
        self.token_file = Path(tempfile.mkdtemp(prefix="specd-soak-")) / "token"
        self.token_file.write_text(secrets.token_urlsafe(32) + "\n")
        self.records: list[dict] = []  # one per request
        self.faults: list[dict] = []  # one per fault: time, kind, target
        self.samples: list[dict] = []  # process RSS / fds over time
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.swapped: dict | None = None  # the swapped-in drafter: name, port, process
        self.swaps = 0
        self.url = f"http://127.0.0.1:{self.port}"

    @staticmethod
    def _open(port: int) -> bool:
        import socket

        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    def now(self) -> float:
        return time.monotonic() - self.t0

    # -- the stack ------------------------------------------------------------------------
    def start(self) -> None:
        argv = [sys.executable, "-m", "specd.cli", "up", "--replicas", "2", "--threads", "1", "--port", str(self.port),
                "--verifier-port", str(self.vport), "--drafter-port", str(self.dport), "--admin-key", self.admin,
                "--auth-token-file", str(self.token_file)]
        self.up_log = open(Path(self.token_file.parent) / "up.log", "w")
        self.up = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.up_log, text=True, start_new_session=True)
        line = self.up.stdout.readline()
        if "specd is up" not in line:
            raise RuntimeError(f"specd up did not come up: {line!r}; see {self.up_log.name}")
        metrics = self.up.stdout.readline()  # "metrics: gateway URL, verifier 0 URL, verifier 1 URL, drafter ..."
        self.verifier_metrics = re.findall(r"verifier \d+ (http://\S+?/metrics)", metrics)
        self.http = httpx.Client(base_url=self.url + "/v1", timeout=600)

    def close(self) -> None:
        self.stop.set()
        if self.swapped:
            self.swapped["proc"].kill()
        if self.up.poll() is None:
            self.up.send_signal(signal.SIGTERM)
            try:
                self.up.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.up.pid, signal.SIGKILL)

    def processes(self) -> dict[str, int]:
        """name -> pid: specd up, its children (by role and port), the swapped-in drafter."""
        out = {"up": self.up.pid}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
                cmd = (stat.parent / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except (OSError, ValueError, IndexError):
                continue
            if ppid == self.up.pid and "specd.cli" in cmd:
                role = cmd[cmd.index("specd.cli") + 1]
                port = cmd[cmd.index("--port") + 1] if "--port" in cmd else ""
                out[f"{role}:{port}"] = int(stat.parent.name)
        if self.swapped and self.swapped["proc"].poll() is None:
            out[f"swapped drafter:{self.swapped['port']}"] = self.swapped["proc"].pid
        return out

    # -- traffic --------------------------------------------------------------------------
    def body(self, rng: random.Random) -> tuple[dict, str]:
        kind = rng.choices(["chat", "json", "regex"], [0.85, 0.1, 0.05])[0]
        messages = [{"role": "user", "content": rng.choice(QUESTIONS)}]
        if rng.random() < 1 / 3:
            messages.insert(0, {"role": "system", "content": SYSTEM})
        body = {"messages": messages, "max_tokens": rng.choice([32, 64, 128]),
                "temperature": rng.choice([0.0, 0.7]), "speculative": {"cache_output": False}}
        if kind == "json":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
        elif kind == "regex":
            body["structured_outputs"] = {"regex": "(yes|no), because [a-z ]{5,40}\\."}
        return body, kind

    def one(self, rng: random.Random) -> None:
        body, kind = self.body(rng)
        stream = rng.random() < 0.5
        close_after = rng.randint(1, 4) if stream and rng.random() < 0.1 else None
        rec = {"t": self.now(), "kind": kind, "stream": stream, "temperature": body["temperature"], "outcome": None}
        t0 = time.perf_counter()
        try:
            if not stream:
                r = self.http.post("/chat/completions", json=body)
                rec["replica"] = r.headers.get("x-specd-replica")
                if r.status_code != 200:
                    rec.update(outcome="failed", status=r.status_code, error=r.text[:300])
                else:
                    rec.update(outcome="completed", ttft=time.perf_counter() - t0)
            else:
                with self.http.stream("POST", "/chat/completions", json={**body, "stream": True}) as r:
                    rec["replica"] = r.headers.get("x-specd-replica")
                    if r.status_code != 200:
                        r.read()
                        rec.update(outcome="failed", status=r.status_code, error=r.text[:300])
                    else:
                        self._read_stream(r, rec, t0, close_after)
        except httpx.HTTPError as e:
            rec.update(outcome="failed", status=None, error=f"{type(e).__name__}: {e}"[:300])
        rec["end"] = self.now()
        with self.lock:
            self.records.append(rec)

    def _read_stream(self, r, rec: dict, t0: float, close_after: int | None) -> None:
        chunks, last, itl = 0, None, []
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                rec["outcome"] = rec["outcome"] or "completed"
                break
            obj = json.loads(line[6:])
            if "error" in obj:  # an in-stream error event: a clean end
                rec.update(outcome="failed", status="event", error=obj["error"].get("message", "")[:300])
                continue
            now = time.perf_counter()
            if chunks == 0:
                rec["ttft"] = now - t0
            elif last is not None:
                itl.append(now - last)
            last, chunks = now, chunks + 1
            if close_after is not None and chunks >= close_after:
                rec["outcome"] = "closed"  # the client leaves mid-stream on purpose
                break
        rec["itl"] = statistics.median(itl) if itl else None
        if rec["outcome"] is None:
            rec.update(outcome="failed", status="eof", error="the stream ended without [DONE]")

    def client(self, index: int) -> None:
        rng = random.Random(index)
        while not self.stop.is_set():
            step = int(self.now() // 60) % len(CONCURRENCY)
            if index >= CONCURRENCY[step]:
                time.sleep(0.5)
                continue
            self.one(rng)

    # -- greedy exactness -----------------------------------------------------------------
    def greedy(self, k: int | None) -> list[str]:
        out = []
        for q in QUESTIONS:
            spec = {"cache_output": False, **({"num_speculative_tokens": k} if k is not None else {})}
            r = self.http.post("/chat/completions", json={"messages": [{"role": "user", "content": q}], "max_tokens": 48,
                                                         "temperature": 0, "speculative": spec})
            out.append(r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else f"<{r.status_code}>")
        return out

    # -- faults ---------------------------------------------------------------------------
    def faults_loop(self) -> None:
        a = self.args
        due = {"swap": a.swap_every * 60, "kill drafter": a.kill_drafter_every * 60,
               "kill replica": a.kill_replica_every * 60}
        replica = 0
        while not self.stop.wait(1.0):
            t = self.now()
            for kind, at in list(due.items()):
                if t < at:
                    continue
                due[kind] = at + {"swap": a.swap_every, "kill drafter": a.kill_drafter_every,
                                  "kill replica": a.kill_replica_every}[kind] * 60
                try:
                    if kind == "swap":
                        target = self.swap()
                    elif kind == "kill drafter":
                        target = self.kill_drafter()
                    else:
                        target = self.kill_replica(replica)
                        replica = 1 - replica
                    self.faults.append({"t": t, "kind": kind, "target": target})
                except Exception as e:  # noqa: BLE001 - a fault that could not be made is reported, not fatal
                    self.faults.append({"t": t, "kind": kind, "error": f"{type(e).__name__}: {e}"[:300]})

    def _start_drafter(self, name: str, port: int) -> subprocess.Popen:
        from specd.models import model_store

        env = dict(os.environ, SPECD_AUTH_TOKEN=self.token_file.read_text().strip(), OMP_NUM_THREADS="1")
        proc = subprocess.Popen([sys.executable, "-m", "specd.cli", "drafter", "--method", "draft_model", "--name", name,
                                 "--model", model_store.default_drafter(), "--port", str(port),
                                 "--metrics-port", str(free_port()), "--threads", "1", "--log-level", "warning"],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        from specd.cli.readiness import grpc_serving
        from specd.rpc import auth

        security = auth.Security(secret=self.token_file.read_text().strip())
        deadline = time.monotonic() + 120
        while not grpc_serving(f"127.0.0.1:{port}", security):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"drafter {name} did not come up")
            time.sleep(0.5)
        return proc

    def _admin(self, method: str, path: str, body: dict | None = None) -> httpx.Response:
        r = httpx.request(method, f"{self.url}{path}", json=body, timeout=120,
                          headers={"authorization": f"Bearer {self.admin}"})
        if r.status_code >= 300:
            raise RuntimeError(f"{method} {path}: {r.status_code} {r.text[:200]}")
        return r

    def swap(self) -> str:
        """A new drafter in, the last swapped-in one drained out. With a replica down (killed, being
        started again) the registration fails there: the new drafter is stopped and the swap counts as
        not made (it is tried again at the next swap)."""
        self.swaps += 1
        name, port = f"swap{self.swaps}", free_port()
        proc = self._start_drafter(name, port)
        try:
            self._admin("POST", "/admin/drafters", {"name": name, "address": f"127.0.0.1:{port}"})
        except RuntimeError:
            proc.kill()
            proc.wait()
            raise
        old, self.swapped = self.swapped, {"name": name, "port": port, "proc": proc}
        if old is not None:
            try:
                self._admin("DELETE", f"/admin/drafters/{old['name']}")
            except RuntimeError as e:  # a replica started again since knows it no more: gone there already
                if " 404 " not in str(e):
                    raise
            finally:
                old["proc"].terminate()
                old["proc"].wait(30)
        return f"{old['name'] if old else '-'} -> {name}"

    def kill_drafter(self) -> str:
        if self.swapped is None:  # before the first swap: the stack's own draft_model service
            pid = self.processes().get(f"drafter:{self.dport}")
            os.kill(pid, signal.SIGKILL)  # `specd up` starts it again
            return f"drafter:{self.dport} (specd up restarts it)"
        s = self.swapped
        s["proc"].kill()
        s["proc"].wait()
        s["proc"] = self._start_drafter(s["name"], s["port"])  # the replicas reconnect to the same address
        return f"{s['name']} at {s['port']} (restarted)"

    def kill_replica(self, index: int) -> str:
        port = self.vport + index
        os.kill(self.processes()[f"verifier:{port}"], signal.SIGKILL)  # `specd up` starts it again
        return f"verifier:{port}"

    # -- measurements ---------------------------------------------------------------------
    def sample_loop(self) -> None:
        while not self.stop.wait(30.0):
            self.samples.append({"t": self.now(), "procs": self.proc_stats()})

    def proc_stats(self) -> dict[str, dict]:
        out = {}
        for name, pid in self.processes().items():
            try:
                rss = int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1)) * 1024
                fds = [os.readlink(f) for f in Path(f"/proc/{pid}/fd").iterdir()]
            except (OSError, AttributeError):
                continue
            g = gauges(pid)
            kv = g.get("kv")
            out[name] = {"pid": pid, "rss_mb": rss / 2**20, "fds": len(fds),
                         "sockets": sum(f.startswith("socket:") for f in fds), "sequences": g.get("sequences"),
                         "kv_mb": kv / 2**20 if kv is not None else None,
                         "outside_kv_mb": (rss - kv) / 2**20 if kv is not None else None}
        return out

    def free_blocks(self) -> list[float | None]:
        out = []
        for url in self.verifier_metrics:
            try:
                text = urllib.request.urlopen(url, timeout=10).read().decode()
                out.append(float(re.search(r"^specd_verifier_kv_blocks_free (\S+)$", text, re.M).group(1)))
            except (OSError, AttributeError):
                out.append(None)
        return out

    def idle(self) -> None:
        """Until no request runs on either replica (their Info load), at most 2 minutes."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                health = httpx.get(f"{self.url}/health", timeout=10).json()
            except (httpx.HTTPError, ValueError):
                health = {}
            if health.get("status") == "ok" and all(not r.get("requests") for r in health.get("replicas", [])):
                time.sleep(2)
                return
            time.sleep(1)


def killed_in_flight(rec: dict, faults: list[dict]) -> bool:
    """A failed request that was running when a replica was killed (the only failures allowed)."""
    return any(f["kind"] == "kill replica" and "target" in f and rec["t"] <= f["t"] + 1.0 and rec["end"] >= f["t"]
               for f in faults)


def percentile(xs: list[float], q: float) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def windows(records: list[dict], samples: list[dict], faults: list[dict], width: float, total: float) -> list[dict]:
    rows = []
    for start in range(0, int(total), int(width)):
        rs = [r for r in records if start <= r["t"] < start + width]
        if start + width > total + 1 and not rs:  # the traffic's end: nothing in this window's stub
            break
        failed = [r for r in rs if r["outcome"] == "failed"]
        last = [s for s in samples if s["t"] < start + width]
        rows.append({"start_min": start / 60, "sent": len(rs), "completed": sum(r["outcome"] == "completed" for r in rs),
                     "closed": sum(r["outcome"] == "closed" for r in rs), "failed": len(failed),
                     "failed_killed_replica": sum(killed_in_flight(r, faults) for r in failed),
                     "ttft_p50": percentile([r.get("ttft") for r in rs], 0.5),
                     "ttft_p99": percentile([r.get("ttft") for r in rs], 0.99),
                     "itl_p50": percentile([r.get("itl") for r in rs], 0.5),
                     "itl_p99": percentile([r.get("itl") for r in rs], 0.99),
                     "procs": last[-1]["procs"] if last else {},
                     "faults": [f for f in faults if start <= f["t"] < start + width]})
    return rows


def render(r: dict) -> str:
    s, rows = r["settings"], r["rows"]
    total = s["total"]
    lines = ["# Soak: `specd up --replicas 2` under mixed traffic and faults (bench/soak.py)", "",
             f"{s['minutes']} minutes; faults: a drafter swap every {s['swap_every']} min, the drafter service "
             f"SIGKILLed every {s['kill_drafter_every']} min, a verifier replica SIGKILLed every {s['kill_replica_every']} "
             "min (`specd up` starts it again). Traffic and what is measured: the module docstring. "
             f"Command: `{r['command']}`", "",
             "## Total", "",
             f"- requests: {total['sent']} sent, {total['completed']} completed, {total['closed']} closed by the client "
             f"on purpose, {total['failed']} failed, of which {total['failed_killed_replica']} were in flight on a "
             f"replica killed at that moment; failed otherwise: {total['failed'] - total['failed_killed_replica']}",
             f"- greedy answers of {len(s['greedy_before'])} fixed prompts: {total['greedy_changed']} changed "
             "(k = 0 before the faults against the server's choice after them)",
             f"- free KV blocks of each replica when idle: {s['free_start']} at the start, {s['free_end']} at the end",
             f"- RSS growth from minute 10 to the end, per process: {total['rss_growth']}",
             f"- p99 TTFT first window {rows[0]['ttft_p99']:.2f} s, last window {rows[-1]['ttft_p99']:.2f} s "
             f"({rows[-1]['ttft_p99'] / rows[0]['ttft_p99']:.2f}x)" if rows and rows[0]['ttft_p99'] and rows[-1]['ttft_p99']
             else "- p99 TTFT: too few requests",
             "", "## Failures", ""]
    lines += [f"- {f['t'] / 60:.1f} min, {f['kind']}, {'in flight on a killed replica' if f['allowed'] else 'NOT allowed'}: "
              f"{f['status']} {f['error']}" for f in total["failures"][:40]] or ["- none"]
    lines += ["", "## Per window", "",
              "| from min | sent | completed | closed | failed | of which killed replica | TTFT p50 / p99 s | ITL p50 / p99 ms "
              "| RSS MB (of it KV caches) [drafter: sequences kept] | fds (sockets) | faults |", "|" + "---|" * 11]
    for w in rows:
        procs = w["procs"]
        rss = ", ".join(f"{n.split(':')[0]} {p['rss_mb']:.0f}" + (f" (kv {p['kv_mb']:.0f})" if p.get("kv_mb") else "")
                        + (f" [{p['sequences']:.0f} seqs]" if p.get("sequences") is not None else "")
                        for n, p in sorted(procs.items()) if n != "up")
        fds = ", ".join(f"{p['fds']} ({p['sockets']})" for n, p in sorted(procs.items()) if n != "up")
        f = "; ".join(f"{x['kind']} {x.get('target') or x.get('error')}" for x in w["faults"]) or "-"

        def ms(x):
            return f"{x * 1e3:.0f}" if x is not None else "-"

        def sec(x):
            return f"{x:.2f}" if x is not None else "-"
        lines.append(f"| {w['start_min']:.0f} | {w['sent']} | {w['completed']} | {w['closed']} | {w['failed']} | "
                     f"{w['failed_killed_replica']} | {sec(w['ttft_p50'])} / {sec(w['ttft_p99'])} | "
                     f"{ms(w['itl_p50'])} / {ms(w['itl_p99'])} | {rss} | {fds} | {f} |")
    return "\n".join(lines + ["", machine_line(r), ""])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=60)
    ap.add_argument("--window", type=float, default=5, help="minutes per reported window")
    ap.add_argument("--clients", type=int, default=32, help="client threads (the concurrency steps up to this)")
    ap.add_argument("--swap-every", type=float, default=3)
    ap.add_argument("--kill-drafter-every", type=float, default=7)
    ap.add_argument("--kill-replica-every", type=float, default=10)
    ap.add_argument("--out", type=Path, default=Path("bench/results/soak"))
    args = ap.parse_args(argv)
    info = machine_info(2)
    soak = Soak(args)
    soak.start()
    try:
        soak.idle()
        free_start = soak.free_blocks()
        greedy_before = soak.greedy(0)
        soak.t0 = time.monotonic()
        threads = [threading.Thread(target=soak.client, args=(i,), daemon=True) for i in range(args.clients)]
        threads += [threading.Thread(target=soak.faults_loop, daemon=True),
                    threading.Thread(target=soak.sample_loop, daemon=True)]
        for t in threads:
            t.start()
        while soak.now() < args.minutes * 60:
            time.sleep(5)
            print(f"{soak.now() / 60:.1f} min: {len(soak.records)} requests, "
                  f"{sum(r['outcome'] == 'failed' for r in soak.records)} failed", flush=True)
        soak.stop.set()
        for t in threads:
            t.join(timeout=600)
        total_s = soak.now()
        soak.samples.append({"t": total_s, "procs": soak.proc_stats()})
        soak.idle()
        free_end = soak.free_blocks()
        greedy_after = soak.greedy(None)
    finally:
        soak.close()
    recs = soak.records
    failures = [{"t": r["t"], "kind": r["kind"], "status": r.get("status"), "error": r.get("error"),
                 "allowed": killed_in_flight(r, soak.faults)} for r in recs if r["outcome"] == "failed"]

    def procs_at(t):
        return min(soak.samples, key=lambda x: abs(x["t"] - t))["procs"]

    # Processes alive from minute 10 to the end (the same pid): the killed ones start over each time.
    start, end = procs_at(min(600.0, total_s / 2)), procs_at(total_s)

    def grew(n: str, key: str) -> str:
        if not start[n].get(key) or end[n].get(key) is None:  # no cache there (None or 0)
            return "-"
        return f"{(end[n][key] / start[n][key] - 1) * 100:+.1f}% ({start[n][key]:.0f} -> {end[n][key]:.0f} MB)"

    growth = {n: {"rss": grew(n, "rss_mb"), "kv caches": grew(n, "kv_mb"), "rss outside the kv caches":
                  grew(n, "outside_kv_mb")} for n in start if n in end and end[n]["pid"] == start[n]["pid"]}
    total = {"sent": len(recs), "completed": sum(r["outcome"] == "completed" for r in recs),
             "closed": sum(r["outcome"] == "closed" for r in recs),
             "failed": len(failures), "failed_killed_replica": sum(f["allowed"] for f in failures),
             "greedy_changed": sum(a != b for a, b in zip(greedy_before, greedy_after)), "rss_growth": growth,
             "failures": failures}
    rows = windows(recs, soak.samples, soak.faults, args.window * 60, total_s)
    settings = {**{k: getattr(args, k) for k in ("minutes", "window", "clients", "swap_every", "kill_drafter_every",
                                                 "kill_replica_every")},
                "free_start": free_start, "free_end": free_end, "greedy_before": greedy_before,
                "greedy_after": greedy_after, "total": total, "faults": soak.faults}
    write_result(args.out, "bench/soak.py", argv, info, settings, rows, soak.t0, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
