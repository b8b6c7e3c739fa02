"""`specd drafters swap`: replace a drafter container without failing a request (docs/architecture.md,
"Services": containers).

1. Find the old drafter at the verifier (ListDrafters) and its container from the host part
   of its address (a container name, a network alias such as compose's service name, or an IP).
2. Start the new container on the same network (or --network), with the old one's network
   aliases (so `drafter-dm` keeps naming the draft-model drafter: Prometheus and a restarted
   verifier find the replacement), its compose labels (so `docker compose down`, v1 and v2, removes it),
   its OTEL_*/SPECD_* environment, its secrets (the files mounted under /run/secrets/, e.g. by
   compose.secure.yaml), its healthcheck and its command line with --name/--method/--model
   replaced: so it holds the stack's shared secret and TLS material as the old one did.
3. Wait for grpc.health.v1 SERVING, checked with `docker exec` inside the new container (the
   old container's healthcheck command, which knows its TLS, else a plain check), which works
   wherever the Docker API does (no route from the host to container IPs needed).
4. RegisterDrafter(new, "<container name>:<port>", trusted as the old one was) at the verifier:
   it reaches the new drafter by container name on the shared network, and a trusted one must
   prove there that it holds the secret.
5. RemoveDrafter(old, drain), then stop and remove the old container.
Until step 4 succeeds nothing changed for the verifier: if the new container exits, never
gets healthy within --health-timeout, or the verifier refuses it, the new container is stopped
and removed and the old drafter stays registered (rollback).
"""
from __future__ import annotations

import argparse
import re
import time

DEFAULT_PORT = 50061
HEALTH_CODE = ("import sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; "
               "c = grpc.insecure_channel('127.0.0.1:{port}'); "
               "sys.exit(g.HealthStub(c).Check(h.HealthCheckRequest(), timeout=3).status != h.HealthCheckResponse.SERVING)")
COMPOSE_LABEL = "com.docker.compose."
SECRETS_DIR = "/run/secrets/"
NAME_RE = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$")


def add_arguments(sub) -> None:
    p = sub.add_parser("swap", help="replace a drafter's container with a new one (Docker), no request fails")
    p.add_argument("--old", required=True, help="name of the registered drafter to replace")
    p.add_argument("--image", required=True, help="image of the new drafter, e.g. specd-drafter:v2")
    p.add_argument("--name", default=None, help="name of the new drafter (default: OLD-2, or the next number)")
    p.add_argument("--method", default=None, choices=["draft_model", "ngram", "suffix"],
                   help="proposer of the new drafter (default: the old container's)")
    p.add_argument("--model", default=None, help="draft model path inside the image (default: the old container's)")
    p.add_argument("--network", default=None,
                   help="Docker network shared with the verifier (default: the old drafter container's)")
    # Also accepted after `swap` (the parent parser's --verifier must come before it).
    p.add_argument("--verifier", default=argparse.SUPPRESS, help="verifier gRPC address (default 127.0.0.1:50051)")
    p.add_argument("--health-timeout", type=float, default=300.0,
                   help="seconds the new drafter gets to report SERVING before the swap rolls back")


def swap(args, stub) -> int:
    try:
        import docker
        from docker.errors import DockerException
    except ImportError:
        raise RuntimeError("`specd drafters swap` needs the Docker SDK: pip install 'specd[docker]'") from None
    from specd.v1 import verifier_pb2 as pb

    reply = _rpc(lambda: stub.ListDrafters(pb.ListDraftersRequest(), timeout=args.timeout))
    drafters = {d.name: d for d in reply.drafters}
    if args.old not in drafters:
        raise RuntimeError(f"no drafter named {args.old!r} at the verifier (it has: {', '.join(drafters) or 'none'})")
    new_name = args.name or next_name(args.old, set(drafters))
    if new_name in drafters:
        raise RuntimeError(f"a drafter named {new_name!r} is already registered; pick another --name")
    if not NAME_RE.match(new_name):
        raise RuntimeError(f"--name {new_name!r}: use letters, digits, '.', '_' and '-'")

    try:
        client = docker.from_env()
        client.ping()
    except DockerException as e:
        raise RuntimeError(f"no Docker engine reachable ({_first_line(e)})") from None

    host = split_host(drafters[args.old].address)
    old = find_container(client, host, args.network)
    network = args.network or (_network_of(old, host) if old is not None else None)
    if network is None:
        raise RuntimeError(f"no running container answers to {host!r} (the old drafter's address); "
                           "pass --network NAME, the network the verifier is on")
    try:
        client.networks.get(network)
    except docker.errors.NotFound:
        raise RuntimeError(f"no Docker network named {network!r}") from None

    old_cmd = list(old.attrs["Config"]["Cmd"] or []) if old is not None else []
    command = drafter_command(old_cmd, new_name, args.method, args.model)
    port = int(_flag(command, "--port") or DEFAULT_PORT)
    labels = compose_labels(old) if old is not None else {}
    project = labels.get(COMPOSE_LABEL + "project")
    container_name = f"{project or 'specd'}-drafter-{new_name}"
    aliases = _aliases(old, network) if old is not None else []
    env = {k: v for k, v in (_env(old).items() if old is not None else ()) if k.startswith(("OTEL_", "SPECD_"))}
    restart = (old.attrs["HostConfig"].get("RestartPolicy") or {}) if old is not None else {}
    volumes = secret_volumes(old.attrs.get("Mounts") or []) if old is not None else {}
    healthcheck = (old.attrs["Config"].get("Healthcheck") or None) if old is not None else None

    t0 = time.monotonic()
    try:
        new = client.containers.run(
            args.image, command, name=container_name, detach=True, environment=env, volumes=volumes,
            healthcheck=healthcheck,
            labels={**labels, "specd.swap.replaces": args.old},
            network=network,
            networking_config={network: client.api.create_endpoint_config(aliases=aliases or None)},
            restart_policy={"Name": restart["Name"]} if restart.get("Name") in ("always", "unless-stopped") else None)
    except DockerException as e:
        raise RuntimeError(f"cannot start {args.image}: {_first_line(e)}") from None
    print(f"started {container_name} ({args.image}) on network {network}", flush=True)

    address = f"{container_name}:{port}"
    try:
        wait_healthy(new, health_command(healthcheck, port), args.health_timeout)
        print(f"{container_name} is SERVING after {time.monotonic() - t0:.1f} s", flush=True)
        request = register_request(drafters[args.old], new_name, address)
        _rpc(lambda: stub.RegisterDrafter(request, timeout=max(args.timeout, 60.0)))
    except BaseException as e:  # Ctrl-C included: never leave a half-started drafter behind
        _remove(new)
        if not isinstance(e, Exception):
            raise
        raise RuntimeError(f"{_first_line(e)}; rolled back: {container_name} removed, {args.old} still serves") from None
    print(f"registered {new_name} at {address}" + (" (trusted)" if request.trusted else ""), flush=True)

    try:
        _rpc(lambda: stub.RemoveDrafter(pb.RemoveDrafterRequest(name=args.old, drain=True),
                                        timeout=max(args.timeout, 60.0)))
    except RuntimeError as e:
        raise RuntimeError(f"{e}; {new_name} serves, {args.old} is still registered "
                           f"(retry: specd drafters remove {args.old})") from None
    print(f"drained and removed {args.old}", flush=True)
    if old is not None:
        _remove(old)
        print(f"stopped and removed container {old.name}", flush=True)
    print(f"swapped {args.old} -> {new_name} in {time.monotonic() - t0:.1f} s", flush=True)
    return 0


# ---- pieces, kept free of Docker calls where possible so they are easy to test

def next_name(old: str, taken: set[str]) -> str:
    """dm -> dm-2, dm-2 -> dm-3 (skipping names already registered)."""
    m = re.match(r"^(.*)-(\d+)$", old)
    base, n = (m.group(1), int(m.group(2)) + 1) if m else (old, 2)
    while f"{base}-{n}" in taken:
        n += 1
    return f"{base}-{n}"


def register_request(old, name: str, address: str):
    """RegisterDrafter for the new drafter, trusted as the old one (a DrafterStatus) was: the
    verifier then challenges it to prove it holds the stack's secret, as it did the old one."""
    from specd.v1 import verifier_pb2 as pb

    return pb.RegisterDrafterRequest(name=name, address=address, trusted=old.trusted)


def split_host(address: str) -> str:
    host = address.rpartition(":")[0] if ":" in address else address
    return host.strip("[]")


def drafter_command(old_cmd: list[str], name: str, method: str | None, model: str | None) -> list[str]:
    """The old container's `drafter ...` arguments with --name (and --method/--model) replaced."""
    cmd = list(old_cmd) if old_cmd[:1] == ["drafter"] else ["drafter", "--host", "0.0.0.0",
                                                            "--port", str(DEFAULT_PORT), "--metrics-port", "9402"]
    old_method = _flag(cmd, "--method") or "draft_model"
    if method is not None and method != old_method and model is None:
        cmd = _set_flag(cmd, "--model", None)  # the old draft model means nothing to another method
    cmd = _set_flag(cmd, "--method", method or old_method)
    if model is not None:
        cmd = _set_flag(cmd, "--model", model)
    return _set_flag(cmd, "--name", name)


def _flag(cmd: list[str], flag: str) -> str | None:
    for i, arg in enumerate(cmd):
        if arg == flag and i + 1 < len(cmd):
            return cmd[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _set_flag(cmd: list[str], flag: str, value: str | None) -> list[str]:
    """Replace flag's value in place (None: drop the flag), or append it."""
    out, i, found = [], 0, False
    while i < len(cmd):
        arg, step = cmd[i], 1
        if arg == flag or arg.startswith(flag + "="):
            step = 2 if arg == flag else 1
            if value is not None and not found:
                out += [flag, value]
            found = True
        else:
            out.append(arg)
        i += step
    return out if found or value is None else out + [flag, value]


def find_container(client, host: str, network: str | None):
    """The running container behind `host`: by name or id, else by network alias, IP or compose service."""
    from docker.errors import NotFound

    try:
        c = client.containers.get(host)
        if c.status == "running":
            return c
    except NotFound:
        pass
    matches = []
    for c in client.containers.list():
        nets = c.attrs["NetworkSettings"]["Networks"] or {}
        if network is not None:
            nets = {k: v for k, v in nets.items() if k == network}
        if any(host in (n.get("Aliases") or []) or host == n.get("IPAddress") for n in nets.values()) or \
                (nets and c.labels.get(COMPOSE_LABEL + "service") == host):
            matches.append(c)
    if len(matches) > 1:
        raise RuntimeError(f"{len(matches)} containers answer to {host!r} ({', '.join(c.name for c in matches)}); "
                           "pass --network to pick the stack")
    return matches[0] if matches else None


def _network_of(container, host: str) -> str | None:
    nets = container.attrs["NetworkSettings"]["Networks"] or {}
    for name, n in nets.items():  # the network where the old address resolves, else the first
        if host in (n.get("Aliases") or []) or host == n.get("IPAddress"):
            return name
    return next(iter(nets), None)


def _aliases(container, network: str) -> list[str]:
    n = (container.attrs["NetworkSettings"]["Networks"] or {}).get(network) or {}
    # Docker adds the container's short id as an alias; that one must not travel.
    return [a for a in n.get("Aliases") or [] if not container.id.startswith(a) and a != container.name]


def compose_labels(container) -> dict[str, str]:
    """Compose's labels with a config hash of our own: `down` then removes the new container with
    the stack, and `up` sees a changed service (and recreates it from compose.yaml) instead of a
    stray one. The label must be there: Compose v2 lists only containers that carry it."""
    labels = {k: v for k, v in container.labels.items() if k.startswith(COMPOSE_LABEL)}
    if COMPOSE_LABEL + "config-hash" in labels:
        labels[COMPOSE_LABEL + "config-hash"] = "specd-drafters-swap"
    if COMPOSE_LABEL + "container-number" in labels:
        labels[COMPOSE_LABEL + "container-number"] = str(int(labels[COMPOSE_LABEL + "container-number"]) + 1)
    return labels


def _env(container) -> dict[str, str]:
    return dict(e.split("=", 1) for e in container.attrs["Config"]["Env"] or [] if "=" in e)


def secret_volumes(mounts: list[dict]) -> dict[str, dict]:
    """The old container's bind mounts under /run/secrets/ (Compose file secrets are bind mounts),
    as the Docker SDK's `volumes` argument, read-only: its --auth-token-file and --tls-* flags,
    which the new command keeps, point there. Other mounts stay behind."""
    return {m["Source"]: {"bind": m["Destination"], "mode": "ro"} for m in mounts
            if m.get("Type") == "bind" and m.get("Destination", "").startswith(SECRETS_DIR)}


def health_command(healthcheck: dict | None, port: int) -> list[str]:
    """What `docker exec` runs to see the new drafter SERVING: the old container's healthcheck
    (compose's, with the CA where the drafter serves TLS), else a plaintext gRPC health check."""
    test = (healthcheck or {}).get("Test") or []
    if test[:1] == ["CMD"] and len(test) > 1:
        return list(test[1:])
    if test[:1] == ["CMD-SHELL"] and len(test) == 2:
        return ["/bin/sh", "-c", test[1]]
    return ["python", "-c", HEALTH_CODE.format(port=port)]  # none, or NONE (disabled)


def wait_healthy(container, command: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        container.reload()
        if container.status not in ("created", "running"):
            logs = container.logs(tail=5).decode(errors="replace").strip().splitlines()
            raise RuntimeError(f"{container.name} exited ({container.attrs['State'].get('ExitCode')})"
                               + (f": {logs[-1]}" if logs else ""))
        if container.status == "running" and container.exec_run(command).exit_code == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{container.name} not SERVING within {timeout:g} s")
        time.sleep(1.0)


def _remove(container) -> None:
    from docker.errors import NotFound

    try:
        container.stop(timeout=15)
        container.remove()
    except NotFound:
        pass


def _rpc(call):
    import grpc

    try:
        return call()
    except grpc.RpcError as e:
        raise RuntimeError(f"verifier: {e.code().name.lower()}: {e.details()}") from None


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__
