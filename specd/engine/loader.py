"""Load a Hugging Face checkpoint (local directory or hub id) straight into our modules."""
from __future__ import annotations

import ctypes
import functools
import gc
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from specd.cache import cache_root, file_sha256
from specd.engine.exactness import forward_invariance_failures
from specd.engine.model.config import ModelArchConfig
from specd.engine.model.decoder import CausalLM
from specd.engine.model.fingerprint import weights_fingerprint
from specd.models.gguf_convert import convert_gguf, find_gguf

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
# checkpoint name piece -> (our fused parameter piece, shard index)
_FUSED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


def set_threads(n: int | None) -> None:
    """torch's intra-op threads for this process (None: torch's default)."""
    if n is None:
        return
    if n < 1:
        raise ValueError(f"--threads must be >= 1, got {n}")
    torch.set_num_threads(n)


def resolve_model_dir(model: str, weights: bool = True) -> Path:
    """A local directory, a GGUF file (or a directory holding one and no config.json) converted
    once into the cache (with weights=False its config and tokenizer only), or a hub id fetched
    (or found in the local hub cache)."""
    path = Path(model).expanduser()
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        return gguf_model_dir(gguf_file, weights)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {model!r} has no config.json")
        return path
    return hub_snapshot(model, "model", ["*.json", "*.safetensors", "tokenizer*", "*.jinja"])


def hub_snapshot(model: str, what: str, patterns: list[str]) -> Path:
    """`model`, which is not a local directory, as a hub id: its files matching `patterns`
    fetched (or found in the local hub cache). Anything else, or a hub that cannot give it, is
    one clear FileNotFoundError naming `what` (a model, a head checkpoint)."""
    if not _HUB_ID.match(model) or model.startswith((".", "/", "~")):
        raise FileNotFoundError(f"{what} {model!r} not found: no such directory")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, allow_patterns=patterns))
    except Exception as e:  # offline, unknown repo, gated ...: one clear line
        raise FileNotFoundError(
            f"{what} {model!r} not found: not a local directory and not available from the hub "
            f"({type(e).__name__})"
        ) from None


def gguf_sha256(gguf_file: Path) -> str:
    """The file's sha256, computed once per process while its size and mtime stay (loading a .gguf
    asks for it two or three times: its conversion cache's key, the prefix cache's salt; a 1 GB
    file takes ~1 s to hash)."""
    st = gguf_file.stat()
    return _sha256_of(str(gguf_file.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:
    return file_sha256(Path(path))


def gguf_model_dir(gguf_file: Path, weights: bool = True) -> Path:
    """The Hugging Face directory converted from `gguf_file`: cache_root()/gguf/<sha256[:16]>/, or
    <sha256[:16]>-meta/ with config and tokenizer only (weights=False; the full one serves too).

    Keyed by content, so a renamed or re-downloaded file reuses it and an edited one does not.
    The conversion goes to a temp dir beside it and is renamed into place (atomic), so the
    directory exists only when complete: a crash mid-conversion leaves nothing to trust.
    """
    full = cache_root() / "gguf" / gguf_sha256(gguf_file)[:16]
    out = full if weights else full.with_name(full.name + "-meta")
    if full.is_dir() or out.is_dir():
        return full if full.is_dir() else out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        convert_gguf(gguf_file, tmp, weights)
        try:
            tmp.rename(out)
        except OSError:
            if not out.is_dir():  # not a concurrent conversion that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def read_arch_config(model_dir: Path) -> ModelArchConfig:
    with open(model_dir / "config.json") as f:
        cfg = json.load(f)
    arch = ModelArchConfig.from_hf(cfg)
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        with open(gen_path) as f:
            gen_eos = json.load(f).get("eos_token_id")
        if gen_eos is not None:
            arch.eos_token_ids = list(gen_eos) if isinstance(gen_eos, list) else [gen_eos]
    return arch


def cpu_bfloat16_is_fast() -> bool:
    """Whether `auto` means bfloat16 on this CPU: specd's fused ops built (AVX-512, or AVX2 + FMA).
    Decode streams the weights, and bf16 halves their bytes: with bf16 dot-product units about
    twice float32's speed, and 3.2x (51 vs 16 tok/s, 1 thread) on an AMD EPYC whose hypervisor
    shows AVX2 only, where the ops widen bf16 to float32 in registers. Their matmuls are also
    batch-invariant by construction. Without them (the torch path, whose oneDNN/MKL kernels
    change with the row count) float32 is the safer choice."""
    from specd.kernels import cpu_ops

    return cpu_ops.available()


def resolve_dtype(dtype: str, arch: ModelArchConfig, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
        return DTYPES[dtype]
    if device.type == "cpu":
        fast = cpu_bfloat16_is_fast()
        log.info("dtype auto: %s on this CPU (%s)", "bfloat16" if fast else "float32",
                 "the fused bf16 ops built" if fast else "no fused bf16 ops")
        return torch.bfloat16 if fast else torch.float32
    return DTYPES.get(arch.torch_dtype or "", torch.bfloat16) if arch.torch_dtype != "float32" else torch.float32


@dataclass
class Checkpoint:
    """What a --model argument names, resolved: the directory with its config and tokenizer, the
    architecture, the dtype served (activations and KV cache) and, for a GGUF file served in its
    own quantized types, the file."""
    dir: Path
    arch: ModelArchConfig
    dtype: torch.dtype
    gguf: Path | None = None


def open_checkpoint(model: str, dtype: str, device: torch.device) -> Checkpoint:
    """A GGUF file with quantized matmuls loads in its own types under dtype auto (with bfloat16
    activations): on CPU where the fused CPU ops build, on CUDA its Q8_0 / Q4_0 / Q4_1 parts through
    Triton; an explicit dtype dequantizes it."""
    gguf_file = find_gguf(Path(model).expanduser())
    if gguf_file is not None and dtype == "auto" and device.type in ("cpu", "cuda"):
        from specd.engine.model.gguf_weights import has_quantized_matmuls

        triton = _triton_quantized(device)
        if has_quantized_matmuls(gguf_file, triton):
            if triton or cpu_bfloat16_is_fast():
                model_dir = resolve_model_dir(model, weights=False)
                return Checkpoint(model_dir, read_arch_config(model_dir), torch.bfloat16, gguf_file)
            log.warning("%s: no quantized kernels for %s on this machine; its weights are dequantized",
                        gguf_file, device.type)
    model_dir = resolve_model_dir(model)
    arch = read_arch_config(model_dir)
    return Checkpoint(model_dir, arch, resolve_dtype(dtype, arch, device))


def load_checkpoint(ckpt: Checkpoint, device: torch.device, max_positions: int,
                    batch_invariant: bool = True) -> CausalLM:
    if ckpt.gguf is None:
        return load_model(ckpt.dir, ckpt.arch, ckpt.dtype, device, max_positions, batch_invariant)
    from specd.engine.model.gguf_weights import load_gguf_model

    model = load_gguf_model(ckpt.gguf, ckpt.arch, max_positions, _triton_quantized(device))
    # Keyed by the file's content: what the prefix cache salts its hashes with.
    model.fingerprint = "gguf-" + gguf_sha256(ckpt.gguf)[:27]
    log.info("%s: matmuls in the file's own types (%s), bfloat16 activations", ckpt.gguf.name, model.quantization)
    return _prepared(model, None, ckpt.dtype, device, batch_invariant)


def _triton_quantized(device: torch.device) -> bool:
    """GGUF matmuls through kernels/quant_matmul_triton.py: on CUDA, or forced on CPU (the tests'
    stand-in for a GPU, under TRITON_INTERPRET), where Triton imports."""
    if device.type != "cuda" and os.environ.get("SPECD_FORCE_TRITON") != "1":
        return False
    try:
        import specd.kernels.quant_matmul_triton  # noqa: F401
    except ImportError:
        return False
    return True


def load_model(model_dir: Path, arch: ModelArchConfig, dtype: torch.dtype, device: torch.device,
               max_positions: int, batch_invariant: bool = True) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(arch, max_positions)
    model = model.to_empty(device=device).to(dtype)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for file in _weight_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                target = _load_tensor(params, name, f.get_tensor(name), arch)
                if target:
                    loaded.add(target)
    missing = sorted(_expected_keys(params, arch) - loaded)
    if missing:
        raise ValueError(f"checkpoint {model_dir} is missing weights: {', '.join(missing[:5])}"
                         + (" ..." if len(missing) > 5 else ""))
    model.rotary.build(device, dtype)
    model.fingerprint = weights_fingerprint(model)  # before prepare() repacks the linears
    head_ids = None
    draft_vocab = model_dir / "draft_vocab.json"
    if draft_vocab.is_file():
        with open(draft_vocab) as f:
            ids = json.load(f)["ids"]
        if not ids or not all(0 <= i < arch.vocab_size for i in ids):
            raise ValueError(f"{draft_vocab}: ids must be a non-empty list within [0, {arch.vocab_size})")
        head_ids = torch.tensor(ids, dtype=torch.long)
    return _prepared(model, head_ids, dtype, device, batch_invariant)


def _prepared(model: CausalLM, head_ids: torch.Tensor | None, dtype: torch.dtype, device: torch.device,
              batch_invariant: bool) -> CausalLM:
    """The matmul paths chosen, then the self-test of batch-invariant mode on the real forward."""
    model.prepare(head_ids, batch_invariant)
    _log_matmul_paths(model)
    failures = forward_invariance_failures(model) if batch_invariant else []
    if failures:
        # A WARNING in 16-bit, where a last-bit difference flips greedy tokens often (1 of 9 chat
        # prompts kept its tokens in a batch on an AMD EPYC); float32's rounding rarely does
        # (bench/results/exact_bf16.md), so there the log says it once at INFO. Either way
        # exact = false is reported (Info, metrics, /v1/models, responses).
        level = logging.INFO if dtype == torch.float32 else logging.WARNING
        log.log(level, "batch-invariant mode is off: on this machine (%s, %s, %d threads) %s; greedy output "
                "may change with batching and speculation, and the server reports exact = false",
                device.type, str(dtype).removeprefix("torch."), torch.get_num_threads(), "; ".join(failures))
        model.set_batch_invariant(False)
    model.exact = batch_invariant and not failures
    release_freed_memory()
    return model.eval()


def _log_matmul_paths(model: CausalLM) -> None:
    """Which instructions the fused bf16 CPU matmul takes here (AMX tiles, vdpbf16ps or FMAs: each
    its own bits, kernels/cpu_bf16_matmul.cpp), once per load, for whoever compares machines."""
    from specd.engine.model.linear import InvariantCpuLinear

    widths = sorted({m.in_features for m in model.modules() if isinstance(m, InvariantCpuLinear)})
    if widths:
        names = {"amx": "AMX tiles", "avx512_bf16": "AVX512-BF16 (vdpbf16ps)", "fma": "float32 FMAs"}
        paths = sorted({names[torch.ops.specd_cpu.bf16_matmul_path(k)] for k in widths})
        # (vdpbf16ps, FMA) seconds, where measured; older kernels (a baseline's in bench/verify_rows.py) lack it
        probe = list(torch.ops.specd_cpu.bf16_dot_probe()) if hasattr(torch.ops.specd_cpu, "bf16_dot_probe") else []
        measured = f"vdpbf16ps measured at {probe[0] / probe[1]:.2f}x the FMAs' time here; " if probe else ""
        log.info("bf16 CPU matmul on %s (%sSPECD_CPU_AMX=0 or SPECD_CPU_BF16_DOT=0 turn the dot products off, "
                 "SPECD_CPU_BF16_DOT=1 takes vdpbf16ps unmeasured)", " and ".join(paths), measured)


# glibc's M_MMAP_THRESHOLD (malloc.h): buffers from this size up get mappings of their own.
_M_MMAP_THRESHOLD, LARGE_BUFFER = -3, 1 << 20


def large_buffers_off_the_heap() -> None:
    """Buffers of 1 MiB and more (a prefill chunk's activations) get mappings of their own, handed
    back to the OS when freed. glibc's default raises that threshold to the largest buffer freed so
    far (up to 32 MiB), after which such buffers come from the heap and their pages stay resident:
    30-40 MB more peak RSS over a 512-token prefill of a 1.5B-shaped model (bench/quant.py), for a
    prefill 0-5% faster. A MALLOC_MMAP_THRESHOLD_ in the environment wins."""
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        _glibc("mallopt", _M_MMAP_THRESHOLD, LARGE_BUFFER)


def release_freed_memory() -> None:
    """Hand what loading freed (a GGUF header's parsed metadata, copies made while packing) back
    to the OS before the KV cache is allocated: glibc's malloc keeps freed pages for reuse, and the
    process's peak resident size would carry them (bench/quant.py's memory column: 20-40 MB)."""
    gc.collect()
    _glibc("malloc_trim", 0)


def _glibc(function: str, *args: int) -> None:
    """Call one of glibc's malloc tunings; a no-op under C libraries that lack it (musl, macOS)."""
    try:
        getattr(ctypes.CDLL(None), function)(*args)
    except (OSError, AttributeError):
        pass


def _expected_keys(params: dict, arch: ModelArchConfig) -> set[str]:
    keys = set()
    for name in params:
        fused = next((f for f in (".qkv_proj.", ".gate_up_proj.") if f in name), None)
        n = len(_shard_sizes(fused, arch)) if fused else 0
        keys.update(f"{name}#{i}" for i in range(n)) if fused else keys.add(name)
    return keys


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def _load_tensor(params: dict, name: str, tensor: torch.Tensor, arch: ModelArchConfig) -> str | None:
    if "rotary_emb" in name or (name == "lm_head.weight" and arch.tie_word_embeddings):
        return None
    for piece, (fused, shard) in _FUSED.items():
        if piece in name:
            target = name.replace(piece, fused)
            param = params[target]
            sizes = _shard_sizes(fused, arch)
            start = sum(sizes[:shard])
            param.data[start:start + sizes[shard]].copy_(tensor)
            return f"{target}#{shard}"
    if name not in params:
        return None  # extra tensors (e.g. vision towers) are not ours
    params[name].data.copy_(tensor)
    return name


def _shard_sizes(fused: str, arch: ModelArchConfig) -> list[int]:
    if fused == ".qkv_proj.":
        return [arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim]
    return [arch.intermediate_size, arch.intermediate_size]


def default_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but no CUDA device is available")
    return torch.device(device)
