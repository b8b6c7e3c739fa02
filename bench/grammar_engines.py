"""Which grammar engine for structured output: llguidance vs xgrammar, on this CPU, on the default tokenizer.

    python bench/grammar_engines.py

For each JSON schema of tests/json_schemas.py: the time to compile it (once per schema; specd
caches compiled grammars), then its valid instance (json.dumps, compact) tokenized with the
default target's tokenizer and walked token by token: at every position the engine fills the
allowed-token bitmask over the whole vocabulary (what a decode step or a verify position needs),
then consumes the token. Reported: median and p95 mask time per token over all positions of all
schemas, and compile time per schema, with 1 thread (the engines' own parallelism off).

Writes bench/results/grammar_engines.{md,json}.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from json_schemas import SCHEMAS  # noqa: E402
from machine import machine_info  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def instance_tokens(tokenizer, instance) -> list[int]:
    return tokenizer.encode(json.dumps(instance, separators=(",", ":")), add_special_tokens=False)


def run_llguidance(tok_dir: Path, vocab: int, eos: int, tokenizer) -> dict:
    import llguidance
    import llguidance.torch as lt

    lltok = llguidance.LLTokenizer(str(tok_dir / "tokenizer.json"), n_vocab=vocab, eos_token=eos)
    mask = lt.allocate_token_bitmask(1, vocab)
    compile_s, mask_s = [], []
    options = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    for _, schema, instance in SCHEMAS:
        t = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        m = llguidance.LLMatcher(lltok, grammar)
        compile_s.append(time.perf_counter() - t)
        assert not m.is_error(), m.get_error()
        for tok in instance_tokens(tokenizer, instance):
            t = time.perf_counter()
            lt.fill_next_token_bitmask(m, mask, 0)
            mask_s.append(time.perf_counter() - t)
            assert m.consume_token(tok), (schema, tok, m.get_error())
        assert m.is_accepting()
    return {"compile_s": compile_s, "mask_s": mask_s}


def run_xgrammar(tok_dir: Path, vocab: int, eos: int, tokenizer) -> dict:
    import transformers
    import xgrammar as xgr

    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    mask = xgr.allocate_token_bitmask(1, vocab)
    compile_s, mask_s = [], []
    for _, schema, instance in SCHEMAS:
        t = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
        m = xgr.GrammarMatcher(compiled)
        compile_s.append(time.perf_counter() - t)
        for tok in instance_tokens(tokenizer, instance):
            t = time.perf_counter()
            m.fill_next_token_bitmask(mask, 0)
            mask_s.append(time.perf_counter() - t)
            assert m.accept_token(tok), (schema, tok)
        assert m.is_terminated() or m.accept_token(eos)
    return {"compile_s": compile_s, "mask_s": mask_s}


def summary(r: dict) -> dict:
    ms = sorted(x * 1e6 for x in r["mask_s"])
    return {"positions": len(ms), "mask_us_median": statistics.median(ms), "mask_us_p95": ms[int(0.95 * (len(ms) - 1))],
            "mask_us_mean": statistics.fmean(ms), "compile_ms_median": 1e3 * statistics.median(r["compile_s"]),
            "compile_ms_max": 1e3 * max(r["compile_s"])}


def main() -> int:
    import torch

    torch.set_num_threads(1)
    from specd.models import model_store
    from specd.engine.loader import read_arch_config
    from specd.models.tokenizer import Tokenizer

    tok_dir = model_store.target_dir()
    arch = read_arch_config(tok_dir)
    tokenizer = Tokenizer.from_dir(tok_dir)
    eos = sorted(arch.eos_token_ids)[0]
    info = machine_info(1, "cpu", "-")
    rows = {}
    for name, fn in (("llguidance", run_llguidance), ("xgrammar", run_xgrammar)):
        fn(tok_dir, arch.vocab_size, eos, tokenizer)  # warm: first-use set-up (token tries) is not per schema
        rows[name] = summary(fn(tok_dir, arch.vocab_size, eos, tokenizer))
        print(name, rows[name], file=sys.stderr)
    import importlib.metadata as md

    versions = {n: md.version(n) for n in rows}
    out = {"machine": info, "vocab_size": arch.vocab_size, "schemas": len(SCHEMAS), "rows": rows, "versions": versions}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "grammar_engines.json").write_text(json.dumps(out, indent=1) + "\n")
    m = info
    lines = ["# Grammar engines: mask time per token on this CPU", "", "Command: `python bench/grammar_engines.py`", "",
             f"{len(SCHEMAS)} JSON schemas (tests/json_schemas.py), each compiled once, then its valid instance walked "
             f"token by token with the default target's tokenizer (vocabulary {arch.vocab_size}): at each position "
             "the full-vocabulary bitmask is filled, then the token consumed. 1 thread; after one warm-up pass.", "",
             "| engine | version | positions | mask median (us) | mask p95 (us) | mask mean (us) | compile median (ms) "
             "| compile max (ms) |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {versions[name]} | {r['positions']} | {r['mask_us_median']:.0f} | "
                     f"{r['mask_us_p95']:.0f} | {r['mask_us_mean']:.0f} | {r['compile_ms_median']:.1f} | "
                     f"{r['compile_ms_max']:.1f} |")
    lines += ["", f"Machine: {m['cpu']} ({' '.join(m.get('cpu_flags', []))}), {m['cores']} cores, torch threads 1; "
              f"load average {m['load_avg_start']:.2f} at start; {m['date']}.", ""]
    (RESULTS / "grammar_engines.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
