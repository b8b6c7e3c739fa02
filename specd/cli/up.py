"""`specd up`: the whole stack on one machine — drafters, verifier and gateway as separate
processes talking gRPC on loopback. Waits until every one is healthy, prints the URL, and
stops them all on Ctrl-C or SIGTERM (a child that dies takes the stack down with a message).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

from specd.cli.ports import metrics_ports, replica_metrics_port
from specd.cli.readiness import drafters_registered, grpc_serving, http_ok, wait_ready

HELP = "start gateway + verifier + drafters on this machine (default: SmolLM2-135M-Instruct and its drafter)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="target model directory, .gguf file or hub id (default: SmolLM2-135M-Instruct, fetched once)")
    p.add_argument("--drafter", action="append", default=None, metavar="METHOD[:MODEL]",
                   help="a drafter to start (repeatable): draft_model[:MODEL], ngram[:OPTIONS] or suffix[:OPTIONS] "
                        "(OPTIONS: the drafter's --options JSON) as a drafter service "
                        "(default, with neither this nor --local-drafter: draft_model on the default target's "
                        "trained drafter). The suffix index inside the verifier comes with any of them (drafting "
                        "from the default target's datastore of its own answers too, where the vocabulary matches) "
                        "unless --local-drafter or a suffix service is named")
    p.add_argument("--local-drafter", action="append", default=None, metavar="METHOD[:OPTIONS]",
                   help="an index drafter (suffix or ngram) inside each verifier process instead of a service: "
                        "asked every step for tens of microseconds (repeatable)")
    p.add_argument("--no-speculation", action="store_true", help="no drafters, plain decoding")
    p.add_argument("--host", default="127.0.0.1", help="gateway host (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="gateway port (default 8000)")
    p.add_argument("--verifier-port", type=int, default=50051,
                   help="the verifier's gRPC port; with --replicas N, replica i listens on this + i")
    p.add_argument("--replicas", type=int, default=1,
                   help="verifier processes (each its own target and KV cache, all sharing the drafters) "
                        "behind the one gateway, which routes by load (default 1)")
    p.add_argument("--routing", default="prefix", choices=["prefix", "least-loaded"],
                   help="how the gateway picks a replica: by a long prompt's first 512 tokens, weighed "
                        "against load (prefix, default), or by load alone")
    p.add_argument("--drafter-port", type=int, default=50061, help="first drafter port; the next ones count up")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="verifier /metrics port (replica i: this + i); drafters use the next ones (default: "
                        "each service's gRPC port + 1000; 0: off). The gateway serves its own /metrics")
    p.add_argument("--speculative-config", default=None, help="verifier speculation settings (JSON, vLLM keys)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--stream-interval-ms", type=float, default=None,
                   help="the verifiers send a running request's new tokens at most this often (default 40; 0: every step)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="verifiers recompute every prompt (no KV reuse across requests)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of each verifier (default: its share of the cores this process may use, at most 8)")
    p.add_argument("--drafter-threads", type=int, default=1, help="torch threads per drafter (default 1)")
    p.add_argument("--pipeline", action="store_true",
                   help="pipelined drafting for the draft_model drafter (it drafts ahead while the verifier "
                        "verifies; worth it when drafters have cores of their own)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--admin-key", default=None, help="enables the gateway's /admin/* with this key")
    p.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="serve every hop over TLS with this certificate (it must name 127.0.0.1 and --host): "
                        "gRPC between the services and HTTPS at the gateway")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="the certificate's private key")
    p.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="CA bundle the services verify each other against (default: the certificate itself)")
    p.add_argument("--auth-token-file", default=None, metavar="FILE",
                   help="shared secret of the gRPC hops (default: $SPECD_AUTH_TOKEN, else a new random one, "
                        "left for `specd drafters` in $SPECD_CACHE/up/verifier-PORT.token)")
    p.add_argument("--log-level", default="warning", help="log level of the services (default warning)")


def parse_drafter(value: str) -> tuple[str, str | None]:
    """METHOD[:MODEL] for draft_model, METHOD[:JSON options] for ngram and suffix -> (method, model or options)."""
    method, _, rest = value.partition(":")
    if method not in ("draft_model", "ngram", "suffix"):
        raise ValueError(f"--drafter: unknown method {method!r} (draft_model[:MODEL], ngram[:OPTIONS] or suffix[:OPTIONS])")
    if rest and method != "draft_model":
        try:
            if not isinstance(json.loads(rest), dict):
                raise ValueError
        except ValueError:
            raise ValueError(f"--drafter: {method} takes JSON options after the colon (e.g. "
                             f"suffix:{{\"suffix_decoding_max_cached_requests\": 0}}), got {rest!r}") from None
    return method, rest or None


def local_label(method: str, options: str | None) -> str:
    store = json.loads(options).get("suffix_decoding_datastore") if options else None
    return f"{method} (in the verifier" + (f", with the datastore {store})" if store else ")")


def default_suffix(target: str | None) -> tuple[str, str]:
    """(the suffix index inside the verifier, what it drafts from). It always drafts from each
    request's own text and earlier answers; from the default target's answers committed beside its
    drafter (models/SmolLM2-135M-Instruct-datastore) too where the target has that vocabulary (a
    datastore of another tokenizer's ids would only cost drafts)."""
    from specd.models import model_store

    own = "each request's own text and earlier answers"
    store = model_store.committed_datastore_dir()
    if store is None:
        return "suffix", own
    if target:
        target_hash = target_vocab_hash(target)
        if target_hash != json.loads((store / "config.json").read_text()).get("vocab_hash"):
            why = "is of another vocabulary" if target_hash else "could not be checked against the target's vocabulary here"
            return "suffix", f"{own} (not the default datastore: it {why})"
    return f"suffix:{json.dumps({'suffix_decoding_datastore': str(store)})}", f"{own} and the default datastore"


def target_vocab_hash(target: str) -> str:
    """The target's token table hash ("" where it cannot be read without the weights here: a hub
    id not in the local cache, a file of a tokenizer type we do not convert)."""
    from specd.engine.loader import resolve_model_dir
    from specd.models.tokenizer import vocab_hash_of

    try:
        return vocab_hash_of(resolve_model_dir(target, weights=False))
    except Exception:  # noqa: BLE001 - only a choice of drafters hangs on it; the verifier reports load errors
        return ""


class Stack:
    """Child processes with prefixed output; stop() terminates them all (then kills stragglers).
    Every child gets the stack's shared secret in its environment (never on a command line)."""

    def __init__(self, secret: str | None = None):
        self.children: list[tuple[str, subprocess.Popen]] = []
        self.argv: dict[str, list[str]] = {}
        self.secret = secret

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        from specd.rpc.auth import TOKEN_ENV

        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.secret:
            env[TOKEN_ENV] = self.secret
        proc = subprocess.Popen([sys.executable, "-m", "specd.cli", *argv], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=env, text=True, start_new_session=True)
        threading.Thread(target=self._relay, args=(name, proc), daemon=True).start()
        self.children = [(n, p) for n, p in self.children if n != name] + [(name, proc)]
        self.argv[name] = argv
        return proc

    def restart(self, name: str) -> subprocess.Popen:
        """The child `name` again, as it was started (same ports: its peers reconnect to it)."""
        return self.start(name, self.argv[name])

    @staticmethod
    def _relay(name: str, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            sys.stderr.write(f"[{name}] {line}")

    def dead(self) -> list[tuple[str, int]]:
        return [(n, p.returncode) for n, p in self.children if p.poll() is not None]

    def stop(self, timeout: float = 10.0) -> None:
        for _, proc in reversed(self.children):  # gateway first: no new requests while the rest stops
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for _, proc in self.children:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


RESTARTS_PER_MINUTE = 5  # a child that dies more often than this is not coming back: the stack goes down


def supervise(stack: Stack, stopping: threading.Event) -> None:
    """Until stopped: a child that exits is started again as it was (a verifier replica, a drafter or
    the gateway: the others reconnect to it, and a gateway routes around a replica meanwhile), unless it
    keeps dying (RESTARTS_PER_MINUTE), which takes the stack down with its log above."""
    restarts: dict[str, list[float]] = {}
    while not stopping.is_set():
        now = time.monotonic()
        for name, code in stack.dead():
            recent = [t for t in restarts.get(name, []) if now - t < 60.0]
            if len(recent) >= RESTARTS_PER_MINUTE:
                raise RuntimeError(f"{name} exited with code {code}, {len(recent) + 1} times within a minute "
                                   "(its log is above)")
            restarts[name] = recent + [now]
            print(f"{name} exited with code {code} (its log is above); starting it again", file=sys.stderr, flush=True)
            stack.restart(name)
        stopping.wait(0.5)


def run(args) -> int:
    from specd.models import model_store
    from specd.rpc.threads import default_threads

    defaults = args.drafter is None and args.local_drafter is None and not args.no_speculation
    # Without drafters named: the default target's trained draft model; for any other target the
    # drafters that need no model (a draft model must share the target's tokenizer: only the user knows one).
    drafters = [parse_drafter(d) for d in (args.drafter or [])] if not defaults else [] if args.target else [
        ("draft_model", None)]
    local = [parse_drafter(d) for d in (args.local_drafter or [])]
    # The suffix index inside the verifier costs nothing to keep: it comes with any drafters named as
    # services (a draft model drafts little of a code edit, which the index copies), unless the user
    # names the drafters inside the verifier or a suffix service.
    if args.local_drafter is None and not args.no_speculation and all(m != "suffix" for m, _ in drafters):
        suffix, source = default_suffix(args.target)
        local = [parse_drafter(suffix)]
        if args.target:  # what it chose, and the one thing only the user can add
            named = ", ".join(m for m, _ in drafters)
            print(f"drafters: {named + ' as a service, and ' if named else 'none named, so '}the suffix index inside "
                  f"the verifier, drafting from {source}"
                  + ("" if drafters else "; --drafter draft_model:FILE_OR_DIR adds a draft model of the same tokenizer"),
                  file=sys.stderr, flush=True)
    if args.no_speculation:
        drafters, local = [], []
    if {m for m, _ in local} & {m for m, _ in drafters}:
        raise ValueError("a method runs either as a service (--drafter) or inside the verifier (--local-drafter), "
                         "not both: they would share a name")
    if any(m == "draft_model" for m, _ in local):
        raise ValueError("--local-drafter takes an index drafter (suffix or ngram); a draft model runs as a service: --drafter")
    threads = args.threads or default_threads(max(1, args.replicas))
    target = args.target or model_store.default_target()
    if any(m == "draft_model" and not model for m, model in drafters):
        if args.target:
            raise ValueError("--drafter draft_model needs a model (draft_model:DIR) when --target is not the default")
        drafters = [(m, model or model_store.default_drafter()) if m == "draft_model" else (m, model)
                    for m, model in drafters]
    from specd.rpc import auth

    # The stack's gRPC hops authenticate with one secret; its drafters hold it too, so they are
    # registered trusted (their sparse q is used). `specd drafters` finds it in the token file.
    secret = auth.read_secret(args.auth_token_file) or auth.generate_secret()
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    verifiers = [f"127.0.0.1:{args.verifier_port + i}" for i in range(args.replicas)]
    drafter_ports = {args.drafter_port + i for i in range(len(drafters))}
    if drafter_ports & {args.verifier_port + i for i in range(args.replicas)}:
        raise ValueError(f"--replicas {args.replicas} from --verifier-port {args.verifier_port} overlaps the "
                         f"drafter ports from --drafter-port {args.drafter_port}: move one of them")
    verifier = verifiers[0]
    tls_ca = args.tls_ca or args.tls_cert
    security = auth.Security(secret=secret, tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=tls_ca)
    server_tls = ["--tls-cert", args.tls_cert, "--tls-key", args.tls_key] if args.tls_cert else []
    client_tls = ["--tls-ca", tls_ca] if tls_ca else []
    scheme = "https" if args.tls_cert else "http"
    token_file = auth.up_token_file(verifier)
    for address in verifiers:  # `specd drafters --verifier ADDRESS` finds it for any replica
        auth.write_secret(auth.up_token_file(address), secret)
    stack = Stack(secret)
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    log = ["--log-level", args.log_level]
    verifier_metrics, drafter_metrics = metrics_ports(args, len(drafters), args.replicas)
    metrics_urls = [("gateway", f"{scheme}://{args.host}:{args.port}/metrics")]
    try:
        checks, drafter_flags, names = [], [], []
        for i, (method, model) in enumerate(drafters):
            name = method if sum(m == method for m, _ in drafters) == 1 else f"{method}-{i}"
            port = args.drafter_port + i
            argv = ["drafter", "--method", method, "--name", name, "--port", str(port),
                    "--metrics-port", str(drafter_metrics[i]), "--threads", str(args.drafter_threads), *log,
                    *server_tls]
            if method == "draft_model":
                argv += ["--model", model] + (["--pipeline"] if args.pipeline else [])
            elif model:
                argv += ["--options", model]
            stack.start(f"drafter {name}", argv)
            checks.append((f"drafter {name}", lambda a=f"127.0.0.1:{port}": grpc_serving(a, security)))
            drafter_flags += ["--trusted-drafter", f"{name}=127.0.0.1:{port}"]
            names.append(name)
            if drafter_metrics[i]:
                metrics_urls.append((f"drafter {name}", f"http://127.0.0.1:{drafter_metrics[i]}/metrics"))
        for method, options in local:
            drafter_flags += ["--local-drafter", f"{method}:{options}" if options else method]
            names.append(method)
        replica_names = ["verifier"] if args.replicas == 1 else [f"verifier {i}" for i in range(args.replicas)]
        for i, (name, address) in enumerate(zip(replica_names, verifiers)):
            # Every replica registers the same drafters: they share them (a drafter keys its
            # sequences by client, one client id per verifier process).
            metrics_port = replica_metrics_port(args, verifier_metrics, i)
            argv = ["verifier", "--model", target, "--port", address.rpartition(":")[2], "--metrics-port",
                    str(metrics_port), "--threads", str(threads), *drafter_flags, *log, *server_tls,
                    *client_tls]
            if metrics_port:
                metrics_urls.insert(1 + i, (name, f"http://127.0.0.1:{metrics_port}/metrics"))
            if args.no_speculation:
                argv.append("--no-speculation")
            if args.speculative_config:
                argv += ["--speculative-config", args.speculative_config]
            if args.max_model_len:
                argv += ["--max-model-len", str(args.max_model_len)]
            if args.stream_interval_ms is not None:
                argv += ["--stream-interval-ms", str(args.stream_interval_ms)]
            if args.no_prefix_caching:
                argv.append("--no-prefix-caching")
            stack.start(name, argv)
            checks.append((name, lambda a=address: grpc_serving(a, security)
                           and drafters_registered(a, names, security)))
        # The gateway starts once the verifiers serve: it reads the model (and tokenizer) from them, and a
        # first start may build the CPU kernels and convert a GGUF for minutes.
        wait_ready(stack, checks, stopping)
        if stopping.is_set():
            return 0
        checks = []
        argv = ["gateway", "--verifier", ",".join(verifiers), "--host", args.host, "--port", str(args.port), *log,
                *client_tls, "--routing", args.routing]
        if args.tls_cert:
            argv += ["--ssl-certfile", args.tls_cert, "--ssl-keyfile", args.tls_key]
        for flag, value in (("--api-key", args.api_key), ("--admin-key", args.admin_key)):
            if value:
                argv += [flag, value]
        stack.start("gateway", argv)
        checks.append(("gateway", lambda: http_ok(f"{scheme}://{args.host}:{args.port}/health", tls_ca, all_serving=True)))
        wait_ready(stack, checks, stopping)
        if stopping.is_set():
            return 0
        url = f"{scheme}://{args.host}:{args.port}/v1"
        model_name = os.path.basename(target.rstrip("/"))
        replicas = f"{args.replicas} verifier replicas; " if args.replicas > 1 else ""
        print(f"specd is up: {url}  (OpenAI API; model {model_name}; {replicas}"
              f"drafters: {', '.join([*(m for m, _ in drafters), *(local_label(m, o) for m, o in local)]) or 'none'}"
              "). Ctrl-C stops it.", flush=True)
        print("metrics: " + ", ".join(f"{n} {u}" for n, u in metrics_urls)
              + ("" if verifier_metrics else " (verifier and drafters off: --metrics-port 0)"), flush=True)
        print(f"gRPC: every hop authenticated with the secret in {token_file} (`specd drafters` reads it"
              + (f"; give it --tls-ca {tls_ca})" if tls_ca else ")"), flush=True)
        print(f"threads: verifier {threads}" + (f", each drafter {args.drafter_threads} (drafters draft while the "
              "verifier waits for them: they share its cores)" if drafters else "")
              + "; the verifier picks its dtype (`auto`: bfloat16 where the fused CPU ops build)", flush=True)
        cacert = f"--cacert {tls_ca} " if tls_ca else ""
        print(f"try: curl -s {cacert}{url}/chat/completions -H 'content-type: application/json' -d "
              f"'{{\"model\": \"{model_name}\", \"messages\": [{{\"role\": \"user\", \"content\": "
              f"\"What is the capital of France?\"}}], \"max_tokens\": 64, \"temperature\": 0}}'", flush=True)
        supervise(stack, stopping)
        return 0
    finally:
        stack.stop()
        for address in verifiers:
            auth.up_token_file(address).unlink(missing_ok=True)
