"""Just enough of `kustomize build` to check deploy/k8s offline (no kustomize binary here).

Follows a kustomization's `resources` (files and directories), turns `secretGenerator` and
`configMapGenerator` entries into Secrets/ConfigMaps with the declared keys (values empty:
the files are per cluster and never committed), and applies strategic merge patches the way
the API server's merge keys say: containers, volumes and env merge by name, ports by
containerPort, volumeMounts by mountPath, a null deletes the field, and every other list
(args, tolerations ...) is replaced whole. Name suffix hashes and `namespace:` are left out;
they change no reference the tests check.
"""
from __future__ import annotations

import copy
from pathlib import Path

import yaml

MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name", "env": "name",
              "ports": "containerPort", "volumeMounts": "mountPath"}


def load_docs(path: Path) -> list[dict]:
    with open(path) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def kustomization(directory: Path) -> dict:
    return load_docs(directory / "kustomization.yaml")[0]


def build(directory: Path) -> list[dict]:
    """The resources `kustomize build directory` would emit, in order."""
    k = kustomization(directory)
    out: list[dict] = []
    for entry in k.get("resources", []):
        path = (directory / entry).resolve()
        out.extend(build(path) if path.is_dir() else load_docs(path))
    for kind, field in (("Secret", "secretGenerator"), ("ConfigMap", "configMapGenerator")):
        for gen in k.get(field, []):
            keys = [f.partition("=")[0] if "=" in f else Path(f).name for f in gen.get("files", [])]
            keys += [lit.partition("=")[0] for lit in gen.get("literals", [])]
            out.append({"apiVersion": "v1", "kind": kind, "metadata": {"name": gen["name"]},
                        ("stringData" if kind == "Secret" else "data"): {key: "" for key in keys}})
    for patch in k.get("patches", []):
        for doc in load_docs(directory / patch["path"]):
            target = [r for r in out if r["kind"] == doc["kind"] and r["metadata"]["name"] == doc["metadata"]["name"]]
            if len(target) != 1:
                raise ValueError(f"{directory / patch['path']}: patches {doc['kind']}/{doc['metadata']['name']}, "
                                 f"which {directory} has {len(target)} of")
            out[out.index(target[0])] = merge(target[0], doc)
    return out


def merge(base, patch, field: str = ""):
    """Strategic merge of patch into base (both left unchanged)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = merge(base[key], value, key) if key in base else copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list) and field in MERGE_KEYS:
        key = MERGE_KEYS[field]
        out = copy.deepcopy(base)
        for item in patch:
            match = [i for i, old in enumerate(out) if old.get(key) == item.get(key)]
            if match:
                out[match[0]] = merge(out[match[0]], item, field)
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(patch)
