"""deploy/k8s: every manifest (base and each overlay, built as kustomize would) validates against
the Kubernetes OpenAPI schema of the versions below (kubernetes-validate, schemas bundled:
offline), strictly (an unknown field fails), and its cross-references hold: Service selectors
and ports, probe ports, volumes, Secrets and their keys, the model paths the fetch initContainer
fills, and each container's arguments, parsed by specd's own CLI parser (k8s_checks.py). Broken
copies must fail. Where kubectl (or kustomize) is installed, the real `kustomize build` is checked the same way and
must agree with kustomize_lite's.
"""
from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from k8s_checks import WORKLOADS, parse_cli, problems
from kustomize_lite import MERGE_KEYS, build, kustomization, load_docs

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
BASE = K8S / "base"
# The oldest release the manifests are written for (gRPC probes GA in 1.27; 1.29 is the
# oldest in upstream support when written) and the newest kubernetes-validate bundles.
K8S_VERSIONS = ["1.29.0", "1.37.0"]
OVERLAYS = sorted(p.parent for p in (K8S / "overlays").glob("*/kustomization.yaml"))
BUILDS = [BASE, *OVERLAYS]


def _id(path: Path) -> str:
    return str(path.relative_to(K8S))


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
