"""Cross-reference checks over one built stack of deploy/k8s (a list of resources, one namespace).

`problems(resources)` lists everything that would break at apply or run time without the
schema noticing: Service selectors and target ports, probe ports and handlers, volumes and the
Secret/ConfigMap keys files are read from, the model paths `specd models fetch` fills, verifier
and drafter addresses, and each container's arguments, parsed by specd's own CLI parser.
"""
from __future__ import annotations

import contextlib
import io
import posixpath
from dataclasses import dataclass, field
from types import SimpleNamespace

WORKLOADS = {"Deployment", "StatefulSet"}
FILE_FLAGS = ("auth_token_file", "tls_cert", "tls_key", "tls_ca", "ssl_certfile", "ssl_keyfile")
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
# Which image runs which subcommand (compose.yaml builds them; `models fetch` needs torch).
IMAGES = {"verifier": {"specd-verifier"}, "drafter": {"specd-drafter"}, "gateway": {"specd-gateway"},
          "models": {"specd-verifier", "specd-drafter"}}


def parse_cli(args: list[str]):
    """(namespace, None) or (None, the parser's error) from specd's real argument parser."""
    from specd.cli import build_parser

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            return build_parser().parse_args(args), None
        except SystemExit:
            return None, err.getvalue().strip() or "exit"


def container_port(container: dict, port) -> int | None:
    """A probe's or Service's port (number or name) as a containerPort of container, else None."""
    for p in container.get("ports", []):
        if port in (p["containerPort"], p.get("name")):
            return p["containerPort"]
    return None


def mount_of(container: dict, path: str) -> dict | None:
    """The volumeMount whose mountPath holds path."""
    for m in container.get("volumeMounts", []):
        if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/"):
            return m
    return None


@dataclass
class Stack:
    resources: list[dict]
    secrets: dict[str, set] = field(init=False)  # name -> keys
    configmaps: dict[str, set] = field(init=False)
    services: dict[str, dict] = field(init=False)
    workloads: list[dict] = field(init=False)

    def __post_init__(self) -> None:
        of = lambda kind: [r for r in self.resources if r["kind"] == kind]  # noqa: E731
        self.secrets = {r["metadata"]["name"]: set(r.get("data", {})) | set(r.get("stringData", {}))
                        for r in of("Secret")}
        self.configmaps = {r["metadata"]["name"]: set(r.get("data", {})) for r in of("ConfigMap")}
        self.services = {r["metadata"]["name"]: r for r in of("Service")}
        self.workloads = [r for r in self.resources if r["kind"] in WORKLOADS]


@dataclass
class Pod:
    """One workload's pod template, as the container checks need it."""
    name: str
    volumes: dict[str, dict]
    fetched: dict[str, str]  # volume name -> the SPECD_CACHE `specd models fetch` filled it as
    scrape_port: int


def problems(resources: list[dict]) -> list[str]:
    stack = Stack(resources)
    out = service_problems(stack)
    verifier_models, gateways = [], []
    for w in stack.workloads:
        pod, found = pod_problems(stack, w)
        out += found
        spec = w["spec"]["template"]["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            ns, found = container_problems(stack, pod, c)
            out += found
            if ns is not None and ns.command == "verifier":
                verifier_models.append(ns.model)
            if ns is not None and ns.command == "gateway":
                gateways.append((pod, c))
    # The gateway loads the tokenizer from the path the verifier reports (its --model).
    for pod, c in gateways:
        for model in verifier_models:
            m = mount_of(c, model or "")
            if m is None or m["name"] not in pod.fetched:
                out.append(f"{pod.name}/{c['name']}: the verifier's model {model} (its tokenizer) is not fetched here")
    return out


def service_problems(stack: Stack) -> list[str]:
    """Each selector picks exactly one workload's pods; each targetPort is a port of its containers."""
    out = []
    for name, svc in stack.services.items():
        selector = svc["spec"].get("selector") or {}
        picked = [w for w in stack.workloads
                  if selector and selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        if len(picked) != 1:
            out.append(f"Service {name}: selector {selector} matches {len(picked)} workloads")
            continue
        containers = picked[0]["spec"]["template"]["spec"]["containers"]
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            if not any(container_port(c, target) for c in containers):
                out.append(f"Service {name}: targetPort {target} is no container port of "
                           f"{picked[0]['metadata']['name']}")
    return out


def pod_problems(stack: Stack, w: dict) -> tuple[Pod, list[str]]:
    name, template = w["metadata"]["name"], w["spec"]["template"]
    spec, out = template["spec"], []
    if not w["spec"]["selector"]["matchLabels"].items() <= template["metadata"].get("labels", {}).items():
        out.append(f"{name}: selector does not match its pod labels")
    if w["kind"] == "StatefulSet":
        svc = stack.services.get(w["spec"]["serviceName"])
        if svc is None or svc["spec"].get("clusterIP") != "None":
            out.append(f"{name}: serviceName {w['spec']['serviceName']} is no headless Service")
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for claim in w["spec"].get("volumeClaimTemplates", []):
        volumes[claim["metadata"]["name"]] = {"persistentVolumeClaim": claim}
    for v in volumes.values():
        if "secret" in v and v["secret"]["secretName"] not in stack.secrets:
            out.append(f"{name}: volume {v['name']} needs Secret {v['secret']['secretName']}, which is not defined")
        if "configMap" in v and v["configMap"]["name"] not in stack.configmaps:
            out.append(f"{name}: volume {v['name']} needs ConfigMap {v['configMap']['name']}, which is not defined")
    fetched = {}
    for c in spec.get("initContainers", []):
        ns, _ = parse_cli(c.get("args", []))
        if ns is None or ns.command != "models" or ns.models_command != "fetch":
            continue
        cache = {e["name"]: e.get("value") for e in c.get("env", [])}.get("SPECD_CACHE")
        m = mount_of(c, cache) if cache else None
        if m is None or m.get("readOnly") or m["mountPath"] != cache:
            out.append(f"{name}/{c['name']}: `models fetch` needs SPECD_CACHE set to a writable volume mount")
        else:
            fetched[m["name"]] = cache
    annotations = template["metadata"].get("annotations", {})
    if annotations.get("prometheus.io/scrape") != "true":
        out.append(f"{name}: no prometheus.io/scrape annotation on its pod template")
    scrape_port = int(annotations.get("prometheus.io/port", 0))
    if not any(container_port(c, scrape_port) for c in spec["containers"]):
        out.append(f"{name}: prometheus.io/port {scrape_port} is no container port")
    return Pod(name, volumes, fetched, scrape_port), out


def container_problems(stack: Stack, pod: Pod, c: dict):
    """(its parsed arguments or None, what is wrong with it)."""
    from specd.models import model_store

    where, out = f"{pod.name}/{c['name']}", []
    for m in c.get("volumeMounts", []):
        if m["name"] not in pod.volumes:
            out.append(f"{where}: mounts volume {m['name']}, which the pod does not have")
    for kind in (k for k in PROBES if k in c):
        handlers = [h for h in ("grpc", "httpGet", "tcpSocket", "exec") if h in c[kind]]
        if len(handlers) != 1:
            out.append(f"{where}: {kind} has {len(handlers)} handlers {handlers}")
        elif handlers[0] == "exec":  # the script and the files it is given must be mounted
            for arg in c[kind]["exec"]["command"]:
                out += file_problems(stack, pod, c, f"{where}: {kind}", arg)
        elif container_port(c, c[kind][handlers[0]]["port"]) is None:
            out.append(f"{where}: {kind} port {c[kind][handlers[0]]['port']} is no container port")
    ns, error = parse_cli(c.get("args", []))
    if ns is None:
        return None, [*out, f"{where}: specd rejects its arguments: {error}"]
    if c["image"].partition(":")[0] not in IMAGES.get(ns.command, set()):
        out.append(f"{where}: `specd {ns.command}` in image {c['image']}")
    for flag in (f for f in FILE_FLAGS if getattr(ns, f, None) is not None):
        out += file_problems(stack, pod, c, f"{where}: --{flag.replace('_', '-')}", getattr(ns, flag), required=True)
    if ns.command in ("verifier", "drafter", "gateway"):
        if ns.host != "0.0.0.0":
            out.append(f"{where}: listens on {ns.host}, unreachable from other pods")
        if container_port(c, ns.port) is None:
            out.append(f"{where}: --port {ns.port} is no container port")
        metrics = ns.port if ns.command == "gateway" else ns.metrics_port  # the gateway's /metrics is on --port
        if metrics != pod.scrape_port:
            out.append(f"{where}: metrics on {metrics} (--metrics-port/--port), "
                       f"prometheus.io/port says {pod.scrape_port}")
    if ns.command == "verifier" or (ns.command == "drafter" and ns.method == "draft_model"):
        expected = model_store.TARGET_NAME if ns.command == "verifier" else model_store.DRAFTER_NAME
        m = mount_of(c, ns.model or "")
        if m is None or m["name"] not in pod.fetched or \
                posixpath.relpath(ns.model, pod.fetched[m["name"]]) != f"models/{expected}":
            out.append(f"{where}: --model {ns.model} is not where `specd models fetch` puts {expected}")
    if ns.command == "verifier":
        out += verifier_problems(stack, where, ns)
    if ns.command == "gateway":
        out += gateway_problems(stack, where, ns)
    return ns, out


def verifier_problems(stack: Stack, where: str, ns) -> list[str]:
    """Drafters named on the command line are Services, and the allow-list admits them and every
    specd-drafter-* Service (checked with the verifier pool's own matching)."""
    from specd.verifier.drafter_pool import DrafterPool

    out = []
    allowed = SimpleNamespace(allowed_addresses=ns.allow_drafter_address or [])
    for name, address in ns.drafter + ns.trusted_drafter:
        out += address_problems(stack, f"{where}: drafter {name}", address)
    if ns.allow_drafter_address is None:
        return out
    addresses = [a for _, a in ns.drafter + ns.trusted_drafter]
    addresses += [f"{svc}:50061" for svc in stack.services if svc.startswith("specd-drafter-")]
    for address in addresses:
        try:
            DrafterPool.check_address(allowed, address)
        except PermissionError as e:
            out.append(f"{where}: {e}")
    return out


def gateway_problems(stack: Stack, where: str, ns) -> list[str]:
    """Every --verifier address exists, and every replica of the verifier StatefulSet is listed."""
    values = ns.verifier if isinstance(ns.verifier, list) else [ns.verifier]  # repeatable since replicas
    addresses = [a for v in values for a in v.split(",")]
    out = [p for a in addresses for p in address_problems(stack, f"{where}: --verifier", a)]
    for sts in stack.workloads:
        name = sts["metadata"]["name"]
        if sts["kind"] != "StatefulSet" or not any(a.startswith(f"{name}-") for a in addresses):
            continue
        wanted = {f"{name}-{i}.{sts['spec']['serviceName']}" for i in range(sts["spec"]["replicas"])}
        missing = wanted - {a.rpartition(":")[0] for a in addresses}
        if missing:  # a replica no gateway knows sits idle
            out.append(f"{where}: --verifier does not list replicas {sorted(missing)}")
    return out


def file_problems(stack: Stack, pod: Pod, c: dict, what: str, path: str, required: bool = False) -> list[str]:
    """path must be a key of the Secret/ConfigMap mounted over it (required: and be on such a mount)."""
    m = mount_of(c, path) if path.startswith("/") else None
    vol = pod.volumes.get(m["name"]) if m else None
    source = vol and (vol.get("secret") or vol.get("configMap"))
    if not source:
        return [f"{what} {path} is on no Secret/ConfigMap mount"] if required else []
    key = posixpath.relpath(path, m["mountPath"])
    items = {i["path"]: i["key"] for i in source.get("items", [])}
    key = items.get(key, key if not items else None)
    keys = stack.secrets.get(source.get("secretName"), stack.configmaps.get(source.get("name"), set()))
    return [] if key in keys else [f"{what} {path}: no such key in its Secret/ConfigMap"]


def address_problems(stack: Stack, what: str, address: str) -> list[str]:
    """address is SERVICE:PORT, or POD.SERVICE:PORT for a StatefulSet's pod behind its headless Service."""
    host, _, port = address.rpartition(":")
    pod, _, svc_name = host.rpartition(".") if "." in host else ("", "", host)
    svc = stack.services.get(svc_name)
    if svc is None:
        return [f"{what} {address}: no Service named {svc_name}"]
    if pod:
        pods = {f"{w['metadata']['name']}-{i}" for w in stack.workloads
                if w["kind"] == "StatefulSet" and w["spec"]["serviceName"] == svc_name
                for i in range(w["spec"]["replicas"])}
        if svc["spec"].get("clusterIP") != "None" or pod not in pods:
            return [f"{what} {address}: no replica {pod} behind headless Service {svc_name}"]
    if int(port) not in [p["port"] for p in svc["spec"]["ports"]]:
        return [f"{what} {address}: Service {svc_name} has no port {port}"]
    return []
