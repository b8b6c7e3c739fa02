"""deploy/k8s: every manifest (base and each overlay, built as kustomize would) validates against
the Kubernetes OpenAPI schema of the versions below (kubernetes-validate, schemas bundled:
offline), strictly (an unknown field fails), and its cross-references hold: Service selectors
and ports, probe ports, volumes, Secrets and their keys, the model paths the fetch initContainer
fills, and each container's arguments, parsed by specd's own CLI parser. Broken copies must fail.
Where kubectl (or kustomize) is installed, the real `kustomize build` is checked the same way and
must agree with kustomize_lite's.
"""
from __future__ import annotations

import contextlib
import copy
import io
import json
import posixpath
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import kubernetes_validate
import pytest
import yaml

from kustomize_lite import MERGE_KEYS, build, kustomization, load_docs

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
BASE = K8S / "base"
# The oldest release the manifests are written for (gRPC probes GA in 1.27; 1.29 is the
# oldest in upstream support when written) and the newest kubernetes-validate bundles.
K8S_VERSIONS = ["1.29.0", "1.37.0"]
OVERLAYS = sorted(p.parent for p in (K8S / "overlays").glob("*/kustomization.yaml"))
BUILDS = [BASE, *OVERLAYS]
WORKLOADS = {"Deployment", "StatefulSet"}
FILE_FLAGS = ("auth_token_file", "tls_cert", "tls_key", "tls_ca", "ssl_certfile", "ssl_keyfile")
# Which image runs which subcommand (compose.yaml builds them; `models fetch` needs torch).
IMAGES = {"verifier": {"specd-verifier"}, "drafter": {"specd-drafter"}, "gateway": {"specd-gateway"},
          "models": {"specd-verifier", "specd-drafter"}}


def _id(path: Path) -> str:
    return str(path.relative_to(K8S))


def parse_cli(args: list[str]):
    """(namespace, None) or (None, the parser's error) from specd's real argument parser."""
    from specd.cli import build_parser

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            return build_parser().parse_args(args), None
        except SystemExit:
            return None, err.getvalue().strip() or "exit"


def _port(container: dict, port) -> int | None:
    """A probe's or Service's port (number or name) as a containerPort of container, else None."""
    for p in container.get("ports", []):
        if port in (p["containerPort"], p.get("name")):
            return p["containerPort"]
    return None


def _mount_of(container: dict, path: str) -> dict | None:
    """The volumeMount whose mountPath holds path."""
    for m in container.get("volumeMounts", []):
        if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/"):
            return m
    return None


def problems(resources: list[dict]) -> list[str]:
    """Every broken cross-reference among resources (one stack, one namespace)."""
    from specd import model_store
    from specd.verifier.drafter_pool import DrafterPool

    out: list[str] = []
    by_kind = lambda kind: [r for r in resources if r["kind"] == kind]  # noqa: E731
    secrets = {r["metadata"]["name"]: set(r.get("data", {})) | set(r.get("stringData", {})) for r in by_kind("Secret")}
    configmaps = {r["metadata"]["name"]: set(r.get("data", {})) for r in by_kind("ConfigMap")}
    workloads = [r for r in resources if r["kind"] in WORKLOADS]
    services = {r["metadata"]["name"]: r for r in by_kind("Service")}
    verifier_models: list[str] = []
    gateway_pods: list[tuple[str, dict]] = []

    # Services: the selector picks exactly one workload's pods; each targetPort is a port of its container.
    for name, svc in services.items():
        selector = svc["spec"].get("selector") or {}
        picked = [w for w in workloads if selector and selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        if len(picked) != 1:
            out.append(f"Service {name}: selector {selector} matches {len(picked)} workloads")
            continue
        containers = picked[0]["spec"]["template"]["spec"]["containers"]
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            if not any(_port(c, target) for c in containers):
                out.append(f"Service {name}: targetPort {target} is no container port of {picked[0]['metadata']['name']}")

    for w in workloads:
        wname = w["metadata"]["name"]
        pod = w["spec"]["template"]
        spec = pod["spec"]
        labels = pod["metadata"].get("labels", {})
        if not w["spec"]["selector"]["matchLabels"].items() <= labels.items():
            out.append(f"{wname}: selector does not match its pod labels")
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        volumes.update({t["metadata"]["name"]: {"persistentVolumeClaim": t} for t in w["spec"].get("volumeClaimTemplates", [])})
        if w["kind"] == "StatefulSet":
            svc = services.get(w["spec"]["serviceName"])
            if svc is None or svc["spec"].get("clusterIP") != "None":
                out.append(f"{wname}: serviceName {w['spec']['serviceName']} is no headless Service")
        for v in volumes.values():
            if "secret" in v and v["secret"]["secretName"] not in secrets:
                out.append(f"{wname}: volume {v['name']} needs Secret {v['secret']['secretName']}, which is not defined")
            if "configMap" in v and v["configMap"]["name"] not in configmaps:
                out.append(f"{wname}: volume {v['name']} needs ConfigMap {v['configMap']['name']}, which is not defined")
        # Models written by `specd models fetch` in an initContainer: volume name -> SPECD_CACHE it used.
        fetched: dict[str, str] = {}
        for c in spec.get("initContainers", []):
            ns, _ = parse_cli(c.get("args", []))
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            cache = env.get("SPECD_CACHE")
            m = _mount_of(c, cache) if cache else None
            if ns is not None and ns.command == "models" and ns.models_command == "fetch":
                if m is None or m.get("readOnly") or m["mountPath"] != cache:
                    out.append(f"{wname}/{c['name']}: `models fetch` needs SPECD_CACHE set to a writable volume mount")
                else:
                    fetched[m["name"]] = cache
        annotations = pod["metadata"].get("annotations", {})
        if annotations.get("prometheus.io/scrape") != "true":
            out.append(f"{wname}: no prometheus.io/scrape annotation on its pod template")
        scrape_port = int(annotations.get("prometheus.io/port", 0))
        if not any(_port(c, scrape_port) for c in spec["containers"]):
            out.append(f"{wname}: prometheus.io/port {scrape_port} is no container port")

        for c in spec.get("initContainers", []) + spec["containers"]:
            where = f"{wname}/{c['name']}"
            for m in c.get("volumeMounts", []):
                if m["name"] not in volumes:
                    out.append(f"{where}: mounts volume {m['name']}, which the pod does not have")
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(kind)
                if probe is None:
                    continue
                handlers = [h for h in ("grpc", "httpGet", "tcpSocket", "exec") if h in probe]
                if len(handlers) != 1:
                    out.append(f"{where}: {kind} has {len(handlers)} handlers {handlers}")
                for h in handlers[:1]:
                    if h != "exec" and _port(c, probe[h]["port"]) is None:
                        out.append(f"{where}: {kind} port {probe[h]['port']} is no container port")
                    if h == "exec":  # the script and the files it is given must be mounted
                        for arg in probe["exec"]["command"]:
                            out += _file_problems(f"{where}: {kind}", arg, c, volumes, secrets, configmaps)
            ns, error = parse_cli(c.get("args", []))
            if ns is None:
                out.append(f"{where}: specd rejects its arguments: {error}")
                continue
            image = c["image"].rpartition(":")[0] if ":" in c["image"] else c["image"]
            if image not in IMAGES.get(ns.command, set()):
                out.append(f"{where}: `specd {ns.command}` in image {c['image']}")
            for flag in FILE_FLAGS:
                path = getattr(ns, flag, None)
                if path is not None:
                    out += _file_problems(f"{where}: --{flag.replace('_', '-')}", path, c, volumes, secrets,
                                          configmaps, required=True)
            if ns.command in ("verifier", "drafter", "gateway"):
                if ns.host != "0.0.0.0":
                    out.append(f"{where}: listens on {ns.host}, unreachable from other pods")
                if _port(c, ns.port) is None:
                    out.append(f"{where}: --port {ns.port} is no container port")
            if ns.command in ("verifier", "drafter"):
                if ns.metrics_port is None or ns.metrics_port != scrape_port:
                    out.append(f"{where}: --metrics-port {ns.metrics_port} is not prometheus.io/port {scrape_port}")
            elif ns.command == "gateway" and ns.port != scrape_port:
                out.append(f"{where}: /metrics is on --port {ns.port}, prometheus.io/port says {scrape_port}")
            model = getattr(ns, "model", None)
            if ns.command in ("verifier", "drafter") and (ns.command == "verifier" or ns.method == "draft_model"):
                expected = model_store.TARGET_NAME if ns.command == "verifier" else model_store.DRAFTER_NAME
                m = _mount_of(c, model or "")
                if m is None or m["name"] not in fetched or \
                        posixpath.relpath(model, fetched[m["name"]]) != f"models/{expected}":
                    out.append(f"{where}: --model {model} is not where `specd models fetch` puts {expected}")
            if ns.command == "verifier":
                verifier_models.append(model)
                startup = ns.drafter + ns.trusted_drafter
                allowed = SimpleNamespace(allowed_addresses=ns.allow_drafter_address or [])
                for name, address in startup:
                    out += _address_problems(where, f"drafter {name}", address, services, workloads)
                    if ns.allow_drafter_address is not None:
                        try:
                            DrafterPool.check_address(allowed, address)
                        except PermissionError as e:
                            out.append(f"{where}: {e}")
                for svc in services:
                    if svc.startswith("specd-drafter-") and ns.allow_drafter_address is not None:
                        try:
                            DrafterPool.check_address(allowed, f"{svc}:50061")
                        except PermissionError:
                            out.append(f"{where}: --allow-drafter-address does not admit Service {svc}")
            if ns.command == "gateway":
                # one address, or (with replica routing) a list of them, each possibly comma-separated
                addresses = [a for v in (ns.verifier if isinstance(ns.verifier, list) else [ns.verifier])
                             for a in v.split(",")]
                for address in addresses:
                    out += _address_problems(where, "--verifier", address, services, workloads)
                # every verifier replica is listed, or it would sit idle
                for sts in (w for w in workloads if w["kind"] == "StatefulSet" and any(
                        a.startswith(f"{w['metadata']['name']}-") for a in addresses)):
                    wanted = {f"{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}"
                              for i in range(sts["spec"]["replicas"])}
                    missing = wanted - {a.rpartition(":")[0] for a in addresses}
                    if missing:
                        out.append(f"{where}: --verifier does not list replicas {sorted(missing)}")
                gateway_pods.append((where, {"c": c, "fetched": fetched}))
    # The gateway loads the tokenizer from the path the verifier reports (its --model).
    for where, pod in gateway_pods:
        for model in verifier_models:
            m = _mount_of(pod["c"], model or "")
            if m is None or m["name"] not in pod["fetched"]:
                out.append(f"{where}: the verifier's model {model} (its tokenizer) is not fetched into this pod")
    return out


def _file_problems(what: str, path: str, container: dict, volumes: dict, secrets: dict, configmaps: dict,
                   required: bool = False) -> list[str]:
    """path must be a key of the Secret/ConfigMap mounted over it (required: and be on such a mount)."""
    m = _mount_of(container, path) if path.startswith("/") else None
    vol = volumes.get(m["name"]) if m else None
    source = vol and (vol.get("secret") or vol.get("configMap"))
    if not source:
        return [f"{what} {path} is on no Secret/ConfigMap mount"] if required else []
    key = posixpath.relpath(path, m["mountPath"])
    items = {i["path"]: i["key"] for i in source.get("items", [])}
    key = items.get(key, key if not items else None)
    keys = secrets.get(source.get("secretName"), configmaps.get(source.get("name"), set()))
    return [] if key in keys else [f"{what} {path}: no such key in its Secret/ConfigMap"]


def _address_problems(where: str, what: str, address: str, services: dict, workloads: list[dict]) -> list[str]:
    """address is SERVICE:PORT, or POD.SERVICE:PORT for a StatefulSet's pod behind its headless Service."""
    host, _, port = address.rpartition(":")
    pod, _, svc_name = host.rpartition(".") if "." in host else ("", "", host)
    svc = services.get(svc_name)
    if svc is None:
        return [f"{where}: {what} {address}: no Service named {svc_name}"]
    if pod:
        pods = {f"{w['metadata']['name']}-{i}" for w in workloads
                if w["kind"] == "StatefulSet" and w["spec"]["serviceName"] == svc_name for i in range(w["spec"]["replicas"])}
        if svc["spec"].get("clusterIP") != "None" or pod not in pods:
            return [f"{where}: {what} {address}: no replica {pod} behind headless Service {svc_name}"]
    if int(port) not in [p["port"] for p in svc["spec"]["ports"]]:
        return [f"{where}: {what} {address}: Service {host} has no port {port}"]
    return []


def validate_all(resources: list[dict], version: str) -> None:
    for r in resources:
        kubernetes_validate.validate(r, version, strict=True)


@pytest.fixture(scope="module", params=BUILDS, ids=_id)
def built(request) -> list[dict]:
    return build(request.param)


def test_kustomization_lists_every_manifest():
    listed = {Path(p).name for p in kustomization(BASE)["resources"]}
    on_disk = {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk
    assert OVERLAYS, "the GPU variant is an overlay"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_validate_against_the_schema(built, version):
    validate_all(built, version)


def test_cross_references_hold(built):
    assert problems(built) == []


def test_every_component_is_there():
    kinds = {(r["kind"], r["metadata"]["name"]) for r in build(BASE)}
    for name in ("specd-gateway", "specd-drafter-dm", "specd-drafter-ngram"):
        assert ("Deployment", name) in kinds and ("Service", name) in kinds
    assert ("StatefulSet", "specd-verifier") in kinds and ("Service", "specd-verifier") in kinds
    assert ("Secret", "specd-grpc") in kinds


def _containers(resources, workload):
    w = next(r for r in resources if r["kind"] in WORKLOADS and r["metadata"]["name"] == workload)
    return {c["name"]: c for c in w["spec"]["template"]["spec"]["containers"]}


def test_verifier_probes_are_grpc_health():
    c = _containers(build(BASE), "specd-verifier")["verifier"]
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[kind]["grpc"]["port"] == 50051


def test_gpu_overlay_requests_gpus_and_runs_cuda():
    gpu = build(K8S / "overlays" / "gpu")
    c = _containers(gpu, "specd-verifier")["verifier"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    ns, _ = parse_cli(c["args"])
    assert ns.device == "cuda"
    base = _containers(build(BASE), "specd-verifier")["verifier"]
    assert "nvidia.com/gpu" not in base["resources"].get("limits", {})


# ---- broken copies must fail ---------------------------------------------------------------

def _deployment(resources, name):
    return next(r for r in resources if r["kind"] in WORKLOADS and r["metadata"]["name"] == name)


def _verifier(resources):
    return _deployment(resources, "specd-verifier")["spec"]["template"]["spec"]["containers"][0]


SCHEMA_BREAKS = {
    "port as a word": lambda rs: _verifier(rs)["ports"][0].update(containerPort="grpc"),
    "misspelt field": lambda rs: _verifier(rs).update(arg=_verifier(rs).pop("args")),
    "probe without a port": lambda rs: _verifier(rs)["readinessProbe"]["grpc"].pop("port"),
    "replicas as text": lambda rs: _deployment(rs, "specd-gateway")["spec"].update(replicas="two"),
}


@pytest.mark.parametrize("name", SCHEMA_BREAKS)
def test_a_broken_copy_fails_the_schema(name):
    resources = copy.deepcopy(build(BASE))
    SCHEMA_BREAKS[name](resources)
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_all(resources, K8S_VERSIONS[0])


def _service(resources, name):
    return next(r for r in resources if r["kind"] == "Service" and r["metadata"]["name"] == name)


def _set_arg(resources, flag, value):
    args = _verifier(resources)["args"]
    args[args.index(flag) + 1] = value


REFERENCE_BREAKS = {
    "selector": (lambda rs: _service(rs, "specd-verifier")["spec"]["selector"].update(
        {"app.kubernetes.io/name": "verifier"}), "matches 0 workloads"),
    "probe port": (lambda rs: _verifier(rs)["readinessProbe"]["grpc"].update(port=50052), "is no container port"),
    "unknown flag": (lambda rs: _verifier(rs)["args"].append("--max-batch-size"), "specd rejects its arguments"),
    "secret name": (lambda rs: next(v for v in _deployment(rs, "specd-verifier")["spec"]["template"]["spec"]["volumes"]
                                    if "secret" in v)["secret"].update(secretName="specd-grcp"), "not defined"),
    "token path": (lambda rs: _set_arg(rs, "--auth-token-file", "/etc/specd/grpc/token"), "no such key"),
    "drafter host": (lambda rs: _set_arg(rs, "--drafter", "dm=drafter-dm:50061"), "no Service named drafter-dm"),
    "model path": (lambda rs: _set_arg(rs, "--model", "/var/cache/specd/SmolLM2-135M-Instruct"), "--model"),
    "metrics port": (lambda rs: _set_arg(rs, "--metrics-port", "9500"), "prometheus.io/port"),
    "replica missing": (lambda rs: _deployment(rs, "specd-verifier")["spec"].update(replicas=3),
                        "does not list replicas ['specd-verifier-2.specd-verifier']"),
    "replica too many": (lambda rs: _deployment(rs, "specd-verifier")["spec"].update(replicas=1),
                         "no replica specd-verifier-1"),
    "not headless": (lambda rs: _service(rs, "specd-verifier")["spec"].pop("clusterIP"), "no headless Service"),
}


@pytest.mark.parametrize("name", REFERENCE_BREAKS)
def test_a_broken_copy_fails_the_cross_checks(name):
    resources = copy.deepcopy(build(BASE))
    break_it, expected = REFERENCE_BREAKS[name]
    break_it(resources)
    found = problems(resources)
    assert any(expected in p for p in found), found


def test_a_broken_tls_probe_fails_the_cross_checks():
    resources = copy.deepcopy(build(K8S / "overlays" / "tls"))
    probe = _verifier(resources)["readinessProbe"]
    assert "grpc" not in probe, "the plaintext probe is replaced, not kept beside the exec one"
    probe["exec"]["command"][1] = "/etc/specd/probe/grpc_health.py"
    assert any("no such key" in p for p in problems(resources))


def test_a_patch_that_misses_its_target_fails(tmp_path):
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(
        {"resources": [str(BASE)], "patches": [{"path": "p.yaml"}]}))
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "specd-verifer"}}))
    with pytest.raises(ValueError, match="specd-verifer"):
        build(tmp_path)
    assert load_docs(tmp_path / "p.yaml")


# ---- against the real kustomize, where one is installed ------------------------------------

KUSTOMIZE = shutil.which("kubectl") or shutil.which("kustomize")


def real_build(directory: Path, tmp: Path) -> list[dict]:
    """`kustomize build` of a copy of deploy/k8s with placeholder secret files."""
    tree = tmp / "k8s"
    if not tree.exists():
        shutil.copytree(K8S, tree)
        for path in ("base/secrets/auth-token", "overlays/tls/secrets/ca.crt", "overlays/tls/secrets/tls.crt",
                     "overlays/tls/secrets/tls.key"):
            (tree / path).parent.mkdir(parents=True, exist_ok=True)
            (tree / path).write_text("placeholder\n")
    cmd = [KUSTOMIZE, "kustomize"] if KUSTOMIZE.endswith("kubectl") else [KUSTOMIZE, "build"]
    done = subprocess.run([*cmd, str(tree / directory.relative_to(K8S))], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def _unhashed(resources: list[dict]) -> list[dict]:
    """Generated names lose kustomize's content hash (and references follow), namespaces go."""
    out = copy.deepcopy(resources)
    hashed = {r["metadata"]["name"]: re.sub(r"-[a-z0-9]{10}$", "", r["metadata"]["name"])
              for r in out if r["kind"] in ("Secret", "ConfigMap")}
    text = json.dumps(out)
    for name, plain in hashed.items():
        text = text.replace(f'"{name}"', f'"{plain}"')
    out = json.loads(text)
    for r in out:
        r["metadata"].pop("namespace", None)
    return out


def _sorted_merge_lists(value, field: str = ""):
    """Lists merged by key in key order: kustomize puts the items a patch adds first, which changes nothing."""
    if isinstance(value, dict):
        return {k: _sorted_merge_lists(v, k) for k, v in value.items()}
    if isinstance(value, list):
        items = [_sorted_merge_lists(v) for v in value]
        return sorted(items, key=lambda i: str(i[MERGE_KEYS[field]])) if field in MERGE_KEYS else items
    return value


@pytest.mark.skipif(KUSTOMIZE is None, reason="no kubectl or kustomize on PATH")
@pytest.mark.parametrize("directory", BUILDS, ids=_id)
def test_real_kustomize_builds_the_same(directory, tmp_path_factory):
    real = real_build(directory, tmp_path_factory.getbasetemp())
    validate_all(real, K8S_VERSIONS[-1])
    assert problems(real) == []
    real, lite = _unhashed(real), build(directory)
    key = lambda r: (r["kind"], r["metadata"]["name"])  # noqa: E731
    assert sorted(map(key, real)) == sorted(map(key, lite))
    lite_by_key = {key(r): r for r in lite}
    for r in real:  # the patches merged as kustomize merges them
        if r["kind"] in WORKLOADS:
            assert _sorted_merge_lists(r["spec"]) == _sorted_merge_lists(lite_by_key[key(r)]["spec"]), key(r)
