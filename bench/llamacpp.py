"""Run llama.cpp's command-line tools as a baseline: plain, speculative and prompt-lookup decoding.

Build the binaries first (outside the repo, under ~/.cache/specd-bench):

    bash bench/build_llamacpp.sh                       # prints the bin dir

Then, e.g.:

    python bench/llamacpp.py run --bin-dir ~/.cache/specd-bench/bin \\
        --model ~/.cache/specd-bench/models/smollm2-135m-instruct-f32.gguf \\
        --modes plain,spec,lookup --draft draft.gguf --threads 2 --max-tokens 128
    python bench/llamacpp.py make-standin-draft --src "$(specd models path target)" --out DIR --layers 2
    python bench/llamacpp.py convert --hf-dir "$(specd models path target)" --outtype f32 --out model.gguf

What is run and what is measured, per prompt:

  plain   llama-completion -no-cnv (falls back to llama-simple, greedy only).
          decode tok/s = llama.cpp's own "eval time = X ms / N runs" (single-token
          decode calls; prompt processing and the first token, which comes out of
          the prompt batch, are excluded; sampling is ~0.03 ms/token, not included).
          Generated tokens = "samplers ... / N tokens" minus the prompt (a final EOS
          counts, as it does in the spec/lookup tools' n_predict).
  spec    llama-speculative-simple -md DRAFT --spec-type draft-simple (this llama.cpp
          refuses to start without an explicit --spec-type), or llama-speculative
          with --spec-binary.
          decode tok/s = "decoded N tokens in T seconds" (wall time of the whole
          draft + verify loop after the prompt), n_drafted / n_accept as printed.
  lookup  llama-lookup (n-gram cache built from the prompt and the output so far), or
          with --lookup-binary llama-speculative-simple --spec-type ngram-simple etc.
          Same numbers as spec.

Prompts are given as chat messages (rendered with the GGUF's tokenizer.chat_template,
or a --chat-template file, through jinja2) or as already-templated text (--raw). The
templated text is written to a file and passed with -f; llama.cpp tokenizes it with
special tokens parsed, and no BOS is added when the GGUF says add_bos_token=false (as
for SmolLM2).

All runs use explicit --threads/--threads-batch (and the same for the draft model),
temperature 0 => greedy (--temp 0 --top-k 1), a fixed --seed, and a timeout.

Shared cores: llama.cpp is built with OpenMP, whose threads spin while waiting. When
another process competes for the cores, 2 threads on 2 cores collapse (measured here
with a training job running: 0.7 tok/s vs 23 tok/s at 1 thread); --omp-wait-policy
passive avoids that (~14-20 tok/s). On an idle machine leave it unset (the default).
Record which one was used: every result carries omp_wait_policy.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

DEFAULT_BENCH_DIR = Path(os.environ.get("SPECD_BENCH_DIR", Path.home() / ".cache" / "specd-bench"))
DEFAULT_BIN_DIR = DEFAULT_BENCH_DIR / "bin"

PLAIN_BINARIES = ("llama-completion", "llama-simple")
SPEC_BINARIES = ("llama-speculative-simple", "llama-speculative")
LOOKUP_BINARIES = ("llama-lookup",)

DEFAULT_PROMPTS: list[list[dict]] = [
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [{"role": "user", "content": "Write a short Python function that returns the n-th Fibonacci number."}],
    [{"role": "user", "content": "Give three tips for staying focused while studying."}],
]


class LlamaCppError(RuntimeError):
    """A llama.cpp run failed, timed out, or its output could not be parsed."""


class BinaryMissing(LlamaCppError):
    """The requested llama.cpp binary is not in the bin dir."""


# --------------------------------------------------------------------------- binaries


def find_binary(bin_dir: str | os.PathLike, names: str | Sequence[str]) -> Path:
    """First of `names` that exists and is executable in bin_dir; BinaryMissing otherwise."""
    if isinstance(names, str):
        names = (names,)
    bin_dir = Path(bin_dir).expanduser()
    for name in names:
        p = bin_dir / name
        if p.is_file() and os.access(p, os.X_OK):
            return p
    have = sorted(x.name for x in bin_dir.iterdir()) if bin_dir.is_dir() else []
    raise BinaryMissing(
        f"none of {list(names)} found in {bin_dir} (present: {have or 'nothing'}); "
        f"build them with: bash bench/build_llamacpp.sh")


def available_binaries(bin_dir: str | os.PathLike) -> dict[str, Path]:
    bin_dir = Path(bin_dir).expanduser()
    if not bin_dir.is_dir():
        return {}
    return {p.name: p for p in sorted(bin_dir.iterdir())
            if p.name.startswith("llama-") and p.is_file() and os.access(p, os.X_OK)}


# --------------------------------------------------------------------------- GGUF metadata

_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                 10: "<Q", 11: "<q", 12: "<d"}


def gguf_metadata(path: str | os.PathLike, keys: Iterable[str] | None = None) -> dict[str, Any]:
    """Read the key/value header of a GGUF file (pure Python; arrays of scalars are
    skipped unless asked for by key). `keys`: stop early once all of them are read."""
    want = set(keys) if keys is not None else None
    out: dict[str, Any] = {}
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise LlamaCppError(f"{path}: not a GGUF file")
        version, = struct.unpack("<I", f.read(4))
        if version < 2:
            raise LlamaCppError(f"{path}: GGUF v{version} not supported")
        _n_tensors, n_kv = struct.unpack("<QQ", f.read(16))

        def read_str() -> str:
            n, = struct.unpack("<Q", f.read(8))
            return f.read(n).decode("utf-8", errors="replace")

        def read_val(t: int, keep: bool):
            if t in _GGUF_SCALARS:
                fmt = _GGUF_SCALARS[t]
                return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
            if t == 8:
                return read_str()
            if t == 9:
                et, n = struct.unpack("<IQ", f.read(12))
                if et in _GGUF_SCALARS and not keep:
                    f.seek(n * struct.calcsize(_GGUF_SCALARS[et]), 1)
                    return None
                vals = [read_val(et, keep) for _ in range(n)]
                return vals if keep else None
            raise LlamaCppError(f"{path}: unknown GGUF value type {t}")

        for _ in range(n_kv):
            key = read_str()
            t, = struct.unpack("<I", f.read(4))
            keep = want is None and t != 9 or (want is not None and key in want)
            val = read_val(t, keep)
            if keep:
                out[key] = val
            if want is not None and want <= out.keys():
                break
    return out


# --------------------------------------------------------------------------- prompts


def render_chat(messages: list[dict], *, model_gguf: str | os.PathLike | None = None,
                template: str | None = None, add_generation_prompt: bool = True) -> str:
    """Render chat messages with a jinja chat template (given, or the GGUF's
    tokenizer.chat_template). BOS is not prepended here; llama.cpp adds it when the
    GGUF asks for it."""
    bos = eos = ""
    if model_gguf is not None:
        md = gguf_metadata(model_gguf, ["tokenizer.chat_template", "tokenizer.ggml.tokens",
                                        "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                                        "tokenizer.ggml.add_bos_token"])
        toks = md.get("tokenizer.ggml.tokens") or []
        eos_id = md.get("tokenizer.ggml.eos_token_id")
        bos_id = md.get("tokenizer.ggml.bos_token_id")
        if eos_id is not None and eos_id < len(toks):
            eos = toks[eos_id]
        # when llama.cpp adds BOS itself (add_bos_token true) the template must not
        if bos_id is not None and bos_id < len(toks) and md.get("tokenizer.ggml.add_bos_token") is False:
            bos = toks[bos_id]
        if template is None:
            template = md.get("tokenizer.chat_template")
    if template is None:
        raise LlamaCppError("no chat template: pass one (--chat-template) or a GGUF that has "
                            "tokenizer.chat_template")
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover
        raise LlamaCppError("jinja2 is needed to render chat templates (pip install jinja2), "
                            "or pass already-templated prompts") from e

    def raise_exception(msg):
        raise jinja2.TemplateError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                            bos_token=bos, eos_token=eos)


# --------------------------------------------------------------------------- parsing

_FLOAT = r"([0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?|nan|inf|-nan|-inf)"
_RE = {
    "load_ms": re.compile(r"load time\s*=\s*" + _FLOAT + r"\s*ms"),
    "prompt_eval": re.compile(r"prompt eval time\s*=\s*" + _FLOAT + r"\s*ms\s*/\s*(\d+)\s*tokens"),
    "eval": re.compile(r"(?<!prompt )eval time\s*=\s*" + _FLOAT + r"\s*ms\s*/\s*(\d+)\s*runs"),
    "sampling": re.compile(r"sampling time\s*=\s*" + _FLOAT + r"\s*ms"),
    # "samplers time = X ms / N tokens": N = prompt tokens + sampled tokens
    "samplers": re.compile(r"samplers time\s*=\s*" + _FLOAT + r"\s*ms\s*/\s*(\d+)\s*tokens"),
    "encoded": re.compile(r"encoded\s+(\d+)\s+tokens in\s+" + _FLOAT + r"\s+seconds"),
    "decoded": re.compile(r"decoded\s+(\d+)\s+tokens in\s+" + _FLOAT + r"\s*s(?:econds)?\b"),
    "n_draft": re.compile(r"(?<![\w])n_draft\s*=\s*(\d+)"),
    "n_predict": re.compile(r"(?<![\w])n_predict\s*=\s*(\d+)"),
    "n_drafted": re.compile(r"(?<![\w])n_drafted\s*=\s*(\d+)"),
    "n_accept": re.compile(r"(?<![\w])n_accept\s*=\s*(\d+)"),
    "accept": re.compile(r"(?<![\w])accept\s*=\s*" + _FLOAT + r"\s*%"),
}


def _last(rx: re.Pattern, text: str):
    m = rx.findall(text)
    return m[-1] if m else None


def _perf_blocks(text: str) -> list[dict]:
    """The llama_perf_context_print blocks, in order (speculative tools print the
    draft context's block first, then the target's)."""
    blocks, cur = [], {}
    for line in text.splitlines():
        if "llama_perf_context_print" not in line and "common_perf_print" not in line:
            continue
        for k in ("load_ms", "prompt_eval", "eval"):
            m = _RE[k].search(line)
            if m:
                if k == "load_ms" and cur:
                    blocks.append(cur)
                    cur = {}
                cur[k] = m.groups()
    if cur:
        blocks.append(cur)
    return blocks


def parse_output(text: str, mode: str) -> dict:
    """Numbers from a llama.cpp tool's combined stdout+stderr."""
    r: dict[str, Any] = {}
    if mode == "plain":
        blocks = _perf_blocks(text)
        if not blocks or "eval" not in blocks[-1]:
            raise LlamaCppError("no 'eval time = ... ms / N runs' line in llama.cpp output")
        b = blocks[-1]
        eval_ms, eval_runs = float(b["eval"][0]), int(b["eval"][1])
        r["eval_ms"], r["eval_runs"] = eval_ms, eval_runs
        if "prompt_eval" in b:
            r["prompt_ms"], r["prompt_tokens"] = float(b["prompt_eval"][0]), int(b["prompt_eval"][1])
        s = _last(_RE["sampling"], text)
        if s:
            r["sampling_ms"] = float(s)
        d = _last(_RE["decoded"], text)  # llama-simple prints this
        sm = _last(_RE["samplers"], text)
        if d:
            r["generated_tokens"] = int(d[0])
        elif sm and "prompt_tokens" in r:
            r["generated_tokens"] = int(sm[1]) - r["prompt_tokens"]  # includes a final EOS
        else:
            # the first token comes out of the prompt batch, each later one costs one eval run
            r["generated_tokens"] = eval_runs + 1
        r["decode_tok_s"] = eval_runs / (eval_ms / 1e3) if eval_ms > 0 else float("nan")
        return r
    # spec / lookup
    d = _last(_RE["decoded"], text)
    if not d:
        raise LlamaCppError("no 'decoded N tokens in T seconds' line in llama.cpp output")
    r["generated_tokens"], r["decode_s"] = int(d[0]), float(d[1])
    r["decode_tok_s"] = r["generated_tokens"] / r["decode_s"] if r["decode_s"] > 0 else float("nan")
    e = _last(_RE["encoded"], text)
    if e:
        r["prompt_tokens"], r["prompt_ms"] = int(e[0]), float(e[1]) * 1e3
    for k in ("n_draft", "n_drafted", "n_accept"):
        v = _last(_RE[k], text)
        if v is not None:
            r[k] = int(v)
    a = _last(_RE["accept"], text)
    if a is not None:
        r["accept_pct"] = float(a)
    if "n_drafted" in r and "n_accept" in r:
        # target forward passes = generated - accepted (each pass yields 1 + accepted tokens)
        r["tokens_per_target_pass"] = (r["generated_tokens"] / max(1, r["generated_tokens"] - r["n_accept"]))
    return r


def generated_text(stdout: str, prompt: str) -> str:
    """Best effort: llama.cpp echoes the prompt, then the generation, on stdout."""
    s = stdout
    i = s.find(prompt.strip()[-40:]) if prompt.strip() else -1
    if i >= 0:
        s = s[i + len(prompt.strip()[-40:]):]
    s = s.strip()
    for tail in ("[end of text]",):
        if s.endswith(tail):
            s = s[: -len(tail)].rstrip()
    return s


# --------------------------------------------------------------------------- running


@dataclasses.dataclass
class RunConfig:
    bin_dir: str = str(DEFAULT_BIN_DIR)
    model: str = ""                 # target GGUF
    draft: str | None = None        # draft GGUF for mode "spec"
    max_tokens: int = 128
    threads: int = 2
    threads_draft: int | None = None  # default: same as threads
    temperature: float = 0.0        # 0 => greedy
    top_k: int | None = None        # default: 1 when greedy, llama.cpp's default otherwise
    top_p: float | None = None
    seed: int = 1234
    ctx_size: int = 4096
    batch_size: int = 2048
    ignore_eos: bool = False        # decode exactly max_tokens (plain; spec/lookup stop at max_tokens+draft)
    draft_max: int = 8              # --spec-draft-n-max (spec, lookup)
    draft_min: int = 0              # --spec-draft-n-min
    draft_p_min: float | None = None  # --spec-draft-p-min (spec): stop drafting below this prob
    spec_binary: str | None = None  # override: llama-speculative-simple / llama-speculative
    spec_type: str = "draft-simple"  # --spec-type for llama-speculative-simple (must be explicit)
    plain_binary: str | None = None
    lookup_binary: str | None = None  # llama-lookup (default) or llama-speculative-simple
    lookup_spec_type: str = "ngram-simple"  # when lookup_binary is llama-speculative-simple
    # OpenMP wait policy for the llama.cpp process (OMP_WAIT_POLICY). None: llama.cpp's
    # default (threads spin). "passive" avoids the collapse seen when another process
    # competes for the cores (2 threads on 2 busy cores: ~0.7 -> ~20 tok/s).
    omp_wait_policy: str | None = None
    extra_args: tuple[str, ...] = ()
    timeout_s: float = 600.0
    keep_output: bool = False       # keep raw stdout/stderr in the result


def _sampling_args(cfg: RunConfig) -> list[str]:
    a = ["--temp", str(cfg.temperature), "--seed", str(cfg.seed)]
    top_k = cfg.top_k if cfg.top_k is not None else (1 if cfg.temperature <= 0 else None)
    if top_k is not None:
        a += ["--top-k", str(top_k)]
    if cfg.top_p is not None:
        a += ["--top-p", str(cfg.top_p)]
    return a


def build_command(mode: str, cfg: RunConfig, prompt_file: str) -> list[str]:
    """The argv for one run. mode: plain | spec | lookup."""
    if not cfg.model:
        raise ValueError("RunConfig.model (target GGUF) is required")
    if not Path(cfg.model).expanduser().is_file():
        raise LlamaCppError(f"target GGUF not found: {cfg.model}")
    t = str(cfg.threads)
    td = str(cfg.threads_draft or cfg.threads)
    common = ["-m", str(Path(cfg.model).expanduser()), "-f", prompt_file, "-n", str(cfg.max_tokens),
              "-c", str(cfg.ctx_size), "-b", str(cfg.batch_size),
              "--threads", t, "--threads-batch", t]
    if mode == "plain":
        exe = find_binary(cfg.bin_dir, (cfg.plain_binary,) if cfg.plain_binary else PLAIN_BINARIES)
        if exe.name == "llama-simple":
            # llama-simple: greedy only, its own tiny arg parser (no thread setting: it uses
            # llama.cpp's default thread count), prompt as positional text
            if cfg.temperature > 0:
                raise LlamaCppError("llama-simple is greedy only; build llama-completion for sampling")
            prompt = Path(prompt_file).read_text()
            return [str(exe), "-m", common[1], "-n", str(cfg.max_tokens), prompt]
        argv = [str(exe), *common, "-no-cnv", "--no-display-prompt", "--simple-io"]
    elif mode == "spec":
        if not cfg.draft:
            raise LlamaCppError("mode 'spec' needs a draft GGUF (--draft)")
        if not Path(cfg.draft).expanduser().is_file():
            raise LlamaCppError(f"draft GGUF not found: {cfg.draft}")
        exe = find_binary(cfg.bin_dir, (cfg.spec_binary,) if cfg.spec_binary else SPEC_BINARIES)
        argv = [str(exe), *common, "-md", str(Path(cfg.draft).expanduser()),
                "--threads-draft", td, "--threads-batch-draft", td,
                "--spec-draft-n-max", str(cfg.draft_max), "--spec-draft-n-min", str(cfg.draft_min)]
        if exe.name == "llama-speculative-simple":
            argv += ["--spec-type", cfg.spec_type]  # without it: "failed to initialize speculative decoding"
        if cfg.draft_p_min is not None:
            argv += ["--spec-draft-p-min", str(cfg.draft_p_min)]
    elif mode == "lookup":
        exe = find_binary(cfg.bin_dir, (cfg.lookup_binary,) if cfg.lookup_binary else LOOKUP_BINARIES)
        argv = [str(exe), *common, "--spec-draft-n-max", str(cfg.draft_max)]
        if exe.name.startswith("llama-speculative"):
            argv += ["--spec-type", cfg.lookup_spec_type, "--spec-draft-n-min", str(cfg.draft_min)]
    else:
        raise ValueError(f"unknown mode {mode!r} (plain | spec | lookup)")
    argv += _sampling_args(cfg)
    if cfg.ignore_eos:
        argv.append("--ignore-eos")
    argv += list(cfg.extra_args)
    return argv


def run_one(mode: str, prompt: str, cfg: RunConfig) -> dict:
    """Run llama.cpp once on an already-templated prompt; return the parsed numbers."""
    with tempfile.TemporaryDirectory(prefix="specd-llamacpp-") as td:
        pf = os.path.join(td, "prompt.txt")
        with open(pf, "w", encoding="utf-8") as f:
            f.write(prompt)
        argv = build_command(mode, cfg, pf)
        env = dict(os.environ)
        # keep OpenMP from spinning up more threads than asked for
        env.setdefault("OMP_NUM_THREADS", str(max(cfg.threads, cfg.threads_draft or 0)))
        if cfg.omp_wait_policy:
            env["OMP_WAIT_POLICY"] = cfg.omp_wait_policy.upper()
        t0 = time.perf_counter()
        try:
            p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                               errors="replace", timeout=cfg.timeout_s, env=env)
        except subprocess.TimeoutExpired as e:
            raise LlamaCppError(f"{Path(argv[0]).name} timed out after {cfg.timeout_s:.0f}s: "
                                f"{' '.join(argv)}") from e
        wall = time.perf_counter() - t0
    out = (p.stdout or "") + "\n" + (p.stderr or "")
    if p.returncode != 0:
        tail = "\n".join(out.strip().splitlines()[-25:])
        raise LlamaCppError(f"{Path(argv[0]).name} exited {p.returncode}: {' '.join(argv)}\n{tail}")
    try:
        r = parse_output(out, mode)
    except LlamaCppError as e:
        tail = "\n".join(out.strip().splitlines()[-25:])
        raise LlamaCppError(f"{e}: {' '.join(argv)}\n{tail}") from None
    r.update(mode=mode, binary=Path(argv[0]).name, wall_s=wall,
             threads=None if Path(argv[0]).name == "llama-simple" else cfg.threads,
             omp_wait_policy=env.get("OMP_WAIT_POLICY"),
             text=generated_text(p.stdout or "", prompt), argv=argv)
    if cfg.keep_output:
        r["stdout"], r["stderr"] = p.stdout, p.stderr
    return r


def run_prompts(mode: str, prompts: Sequence[str | list[dict]], cfg: RunConfig, *,
                chat_template: str | None = None, warmup: int = 1) -> list[dict]:
    """Run `mode` on each prompt (templated text, or a list of chat messages rendered
    with the target's chat template). `warmup` untimed runs of the first prompt first
    (page cache, CPU clocks)."""
    texts = [p if isinstance(p, str) else render_chat(p, model_gguf=cfg.model, template=chat_template)
             for p in prompts]
    for _ in range(warmup):
        if texts:
            run_one(mode, texts[0], dataclasses.replace(cfg, max_tokens=min(cfg.max_tokens, 16)))
    results = []
    for i, t in enumerate(texts):
        r = run_one(mode, t, cfg)
        r["prompt_index"] = i
        results.append(r)
    return results


def summarize(results: Sequence[dict]) -> dict:
    """Aggregate per-prompt results: token-weighted decode tok/s, acceptance."""
    if not results:
        return {}
    gen = sum(r["generated_tokens"] for r in results)
    s: dict[str, Any] = {"mode": results[0]["mode"], "prompts": len(results), "generated_tokens": gen}
    if results[0]["mode"] == "plain":
        runs = sum(r["eval_runs"] for r in results)
        ms = sum(r["eval_ms"] for r in results)
        s["decode_tok_s"] = runs / (ms / 1e3) if ms else float("nan")
    else:
        secs = sum(r["decode_s"] for r in results)
        s["decode_tok_s"] = gen / secs if secs else float("nan")
        if all("n_drafted" in r for r in results):
            s["n_drafted"] = sum(r["n_drafted"] for r in results)
            s["n_accept"] = sum(r["n_accept"] for r in results)
            s["accept_pct"] = 100.0 * s["n_accept"] / s["n_drafted"] if s["n_drafted"] else 0.0
    s["per_prompt_tok_s"] = [round(r["decode_tok_s"], 2) for r in results]
    return s


# --------------------------------------------------------------------------- helpers: models


def convert_hf_to_gguf(hf_dir: str, out: str, outtype: str = "f32", *, python: str | None = None,
                       llama_cpp_dir: str | None = None, timeout_s: float = 1800) -> Path:
    """Run the sdist's convert_hf_to_gguf.py (needs torch, transformers, numpy,
    sentencepiece: build_llamacpp.sh sets up ~/.cache/specd-bench/venv-convert)."""
    src = Path(llama_cpp_dir or DEFAULT_BENCH_DIR / "llama.cpp").expanduser()
    script = src / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise BinaryMissing(f"{script} not found; run bash bench/build_llamacpp.sh")
    if python is None:
        venv_py = DEFAULT_BENCH_DIR / "venv-convert" / "bin" / "python"
        python = str(venv_py) if venv_py.exists() else sys.executable
    Path(out).expanduser().parent.mkdir(parents=True, exist_ok=True)
    argv = [python, str(script), str(hf_dir), "--outtype", outtype, "--outfile", str(Path(out).expanduser())]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    if p.returncode != 0:
        raise LlamaCppError(f"convert failed ({p.returncode}): {' '.join(argv)}\n{p.stderr[-3000:]}")
    return Path(out).expanduser()


def bench_decode(bin_dir: str | os.PathLike, model_gguf: str | os.PathLike, *, threads: int, n_gen: int,
                 depth: int = 0, repetitions: int = 1, cache_type: str | None = None,
                 omp_wait_policy: str | None = None, timeout_s: float = 600.0) -> dict:
    """Plain batch-1 decode speed from llama-bench: `-p 0 -n N -d DEPTH` times N single-token
    decode calls after a DEPTH-token context is filled (the fill and llama-bench's own warm-up
    run are not timed). cache_type sets the KV cache type (e.g. bf16, f32; llama-bench's
    default is f16). tok_s is llama-bench's avg_ts over `repetitions` runs."""
    exe = find_binary(bin_dir, "llama-bench")
    argv = [str(exe), "-m", str(Path(model_gguf).expanduser()), "-p", "0", "-n", str(n_gen), "-d", str(depth),
            "-r", str(repetitions), "-t", str(threads), "-o", "json"]
    if cache_type:
        argv += ["-ctk", cache_type, "-ctv", cache_type]
    env = dict(os.environ)
    if omp_wait_policy:
        env["OMP_WAIT_POLICY"] = omp_wait_policy.upper()
    try:
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env,
                           timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise LlamaCppError(f"llama-bench timed out after {timeout_s:.0f} s: {' '.join(argv)}") from e
    if p.returncode != 0:
        raise LlamaCppError(f"llama-bench failed ({p.returncode}): {' '.join(argv)}\n{p.stderr[-2000:]}")
    try:
        rec = json.loads(p.stdout)[0]
    except (ValueError, IndexError) as e:
        raise LlamaCppError(f"cannot parse llama-bench JSON: {p.stdout[-500:]!r}") from e
    return {"tok_s": rec["avg_ts"], "samples_tok_s": rec["samples_ts"], "model_size": rec["model_size"],
            "n_params": rec["model_n_params"], "type_k": rec["type_k"], "flash_attn": rec["flash_attn"],
            "poll": rec["poll"], "build_commit": rec["build_commit"], "threads": rec["n_threads"],
            "omp_wait_policy": env.get("OMP_WAIT_POLICY"), "argv": argv}


def make_standin_draft(src_hf_dir: str, out_dir: str, n_layers: int = 2, random_init: bool = False,
                       seed: int = 0) -> Path:
    """A small Llama drafter with the target's tokenizer and vocab, for exercising the
    speculative path before a trained drafter exists. Default: the target's embeddings,
    first `n_layers` decoder layers and final norm (a truncated target, so acceptance is
    not ~0); random_init=True: same shapes, random weights."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    src, out = Path(src_hf_dir), Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    cfg = AutoConfig.from_pretrained(src)
    cfg.num_hidden_layers = n_layers
    torch.manual_seed(seed)
    draft = LlamaForCausalLM(cfg).to(torch.float32)
    if not random_init:
        from safetensors.torch import load_file
        sd = {}
        for f in sorted(src.glob("*.safetensors")):
            sd.update(load_file(str(f)))
        keep = {k: v for k, v in sd.items()
                if not k.startswith("model.layers.") or int(k.split(".")[2]) < n_layers}
        missing, unexpected = draft.load_state_dict(keep, strict=False)
        missing = [k for k in missing if k != "lm_head.weight"]  # tied
        if missing or unexpected:
            raise LlamaCppError(f"stand-in draft: missing {missing[:5]}, unexpected {unexpected[:5]}")
    draft.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "special_tokens_map.json", "generation_config.json", "tokenizer.model"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    return out


# --------------------------------------------------------------------------- CLI


def _load_prompts(args) -> list[str | list[dict]]:
    if args.prompts_file:
        data = json.loads(Path(args.prompts_file).read_text())
        # a list of: strings (templated text), message lists, or {"messages": [...]}
        return [d["messages"] if isinstance(d, dict) else d for d in data]
    if args.prompt:
        if args.raw:
            return list(args.prompt)
        return [[{"role": "user", "content": p}] for p in args.prompt]
    return list(DEFAULT_PROMPTS)


def _cmd_run(args) -> int:
    cfg = RunConfig(bin_dir=args.bin_dir, model=args.model, draft=args.draft, max_tokens=args.max_tokens,
                    threads=args.threads, threads_draft=args.threads_draft, temperature=args.temperature,
                    top_k=args.top_k, top_p=args.top_p, seed=args.seed, ctx_size=args.ctx_size,
                    ignore_eos=args.ignore_eos, draft_max=args.draft_max, draft_min=args.draft_min,
                    draft_p_min=args.draft_p_min, spec_binary=args.spec_binary,
                    plain_binary=args.plain_binary, lookup_binary=args.lookup_binary,
                    lookup_spec_type=args.lookup_spec_type, omp_wait_policy=args.omp_wait_policy,
                    timeout_s=args.timeout)
    template = Path(args.chat_template).read_text() if args.chat_template else None
    prompts = _load_prompts(args)
    report: dict[str, Any] = {"config": dataclasses.asdict(cfg), "modes": {}}
    rc = 0
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        try:
            res = run_prompts(mode, prompts, cfg, chat_template=template, warmup=args.warmup)
        except LlamaCppError as e:
            print(f"[{mode}] ERROR: {e}", file=sys.stderr)
            report["modes"][mode] = {"error": str(e)}
            rc = 1
            continue
        summ = summarize(res)
        report["modes"][mode] = {"summary": summ, "per_prompt": res}
        print(f"[{mode}] {res[0]['binary']} threads={res[0]['threads']} omp={res[0]['omp_wait_policy'] or 'default'}: {summ['decode_tok_s']:.2f} tok/s decode, "
              f"{summ['generated_tokens']} tokens over {summ['prompts']} prompts; per prompt {summ['per_prompt_tok_s']}"
              + (f"; drafted {summ['n_drafted']} accepted {summ['n_accept']} ({summ['accept_pct']:.1f}%)"
                 if "n_drafted" in summ else ""))
        if args.show_text:
            for r in res:
                print(f"  --- prompt {r['prompt_index']} ({r['generated_tokens']} tokens): {r['text'][:400]!r}")
    if args.json:
        for m in report["modes"].values():
            for r in m.get("per_prompt", []):
                r.pop("stdout", None), r.pop("stderr", None)
        Path(args.json).write_text(json.dumps(report, indent=2))
    return rc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="run plain / spec / lookup decoding on chat prompts")
    r.add_argument("--bin-dir", default=str(DEFAULT_BIN_DIR))
    r.add_argument("--model", required=True, help="target GGUF")
    r.add_argument("--draft", help="draft GGUF (mode spec)")
    r.add_argument("--modes", default="plain", help="comma list of plain,spec,lookup")
    r.add_argument("--prompt", action="append", help="user message (repeatable); with --raw: templated text")
    r.add_argument("--raw", action="store_true", help="--prompt values are already templated")
    r.add_argument("--prompts-file", help="JSON list of templated strings or message lists")
    r.add_argument("--chat-template", help="jinja file (default: the GGUF's tokenizer.chat_template)")
    r.add_argument("--max-tokens", type=int, default=128)
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--threads-draft", type=int)
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--top-k", type=int)
    r.add_argument("--top-p", type=float)
    r.add_argument("--seed", type=int, default=1234)
    r.add_argument("--ctx-size", type=int, default=4096)
    r.add_argument("--ignore-eos", action="store_true")
    r.add_argument("--draft-max", type=int, default=8)
    r.add_argument("--draft-min", type=int, default=0)
    r.add_argument("--draft-p-min", type=float)
    r.add_argument("--plain-binary", help="llama-completion (default) or llama-simple")
    r.add_argument("--spec-binary", help="llama-speculative-simple (default) or llama-speculative")
    r.add_argument("--lookup-binary", help="llama-lookup (default) or llama-speculative-simple")
    r.add_argument("--lookup-spec-type", default="ngram-simple",
                   help="--spec-type when --lookup-binary is llama-speculative-simple")
    r.add_argument("--omp-wait-policy", choices=["active", "passive"],
                   help="OMP_WAIT_POLICY for llama.cpp (default: unset; passive when the cores are shared)")
    r.add_argument("--warmup", type=int, default=1)
    r.add_argument("--timeout", type=float, default=600.0, help="seconds per llama.cpp run")
    r.add_argument("--show-text", action="store_true")
    r.add_argument("--json", help="write the full report here")
    r.set_defaults(func=_cmd_run)

    c = sub.add_parser("convert", help="HF dir -> GGUF with the sdist's convert_hf_to_gguf.py")
    c.add_argument("--hf-dir", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--outtype", default="f32", choices=["f32", "bf16", "f16", "q8_0"])
    c.add_argument("--python", help="interpreter with torch/transformers/sentencepiece")
    c.set_defaults(func=lambda a: print(convert_hf_to_gguf(a.hf_dir, a.out, a.outtype, python=a.python)) or 0)

    d = sub.add_parser("make-standin-draft", help="truncated (or random) small Llama with the target's vocab")
    d.add_argument("--src", required=True, help="target HF dir (config, weights, tokenizer)")
    d.add_argument("--out", required=True)
    d.add_argument("--layers", type=int, default=2)
    d.add_argument("--random", action="store_true")
    d.set_defaults(func=lambda a: print(make_standin_draft(a.src, a.out, a.layers, a.random)) or 0)

    b = sub.add_parser("list", help="list the llama.cpp binaries found")
    b.add_argument("--bin-dir", default=str(DEFAULT_BIN_DIR))
    b.set_defaults(func=lambda a: print("\n".join(f"{k}\t{v.resolve()}" for k, v in
                                                  available_binaries(a.bin_dir).items()) or "none") or 0)

    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
