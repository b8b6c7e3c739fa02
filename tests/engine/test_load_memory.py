"""What loading a model leaves resident (bench/quant.py measures peak RSS against 1.5 x the file +
the KV cache): the model is built on the meta device without random init, whose meta path imports
torch._dynamo and with it Triton (~65 MB resident, ~1 s), and what loading freed goes back to the OS."""
import subprocess
import sys
import textwrap


def test_loading_imports_neither_dynamo_nor_triton(llama_dir):
    code = textwrap.dedent(f"""
        import sys
        from specd import LLM, SamplingParams
        llm = LLM({llama_dir!r}, device="cpu", dtype="bfloat16", max_model_len=256)
        llm.generate([{{"prompt_token_ids": [1, 2, 3]}}], SamplingParams(temperature=0, max_tokens=4))
        print(sorted(m for m in ("torch._dynamo", "triton") if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_freed_memory_goes_back_to_the_os():
    import ctypes

    from specd.engine.loader import release_freed_memory

    def rss_kb() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

    # 64 MB in holes of the heap (pieces under glibc's mmap threshold, every other one freed, so
    # free() cannot shrink the heap from its top): glibc keeps those pages until trimmed
    pieces = [ctypes.create_string_buffer(64 * 1024) for _ in range(2048)]
    held = rss_kb()
    del pieces[::2]
    assert rss_kb() > held - 16 * 1024
    release_freed_memory()
    assert rss_kb() < held - 32 * 1024


def test_kv_cache_takes_memory_only_for_the_blocks_written(llama_dir):
    """The cache reads as zero everywhere, and the process's resident size grows with the blocks
    written, not with the cache's size at start (a cache of hundreds of MB on a tiny model)."""
    code = textwrap.dedent(f"""
        import torch
        from specd import LLM, SamplingParams
        def rss_mb():
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
        before = rss_mb()
        llm = LLM({llama_dir!r}, device="cpu", dtype="bfloat16", max_model_len=256, num_kv_blocks=80000)
        loaded = rss_mb()
        llm.generate([{{"prompt_token_ids": [1, 2, 3]}}], SamplingParams(temperature=0, max_tokens=4))
        k, v = llm.engine.runner.kv_caches[0]
        untouched = k.shape[0] // 2  # far from the few blocks one short request used
        zero = bool((k[untouched:] == 0).all() and (v[untouched:] == 0).all())
        k[untouched:].fill_(1.0)
        cache_mb = sum(t.numel() * t.element_size() for kv in llm.engine.runner.kv_caches for t in kv) / 2**20
        print(before, loaded, rss_mb(), k[untouched:].numel() * k.element_size() / 2**20, cache_mb, zero)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    *sizes, zero = out.stdout.split()[-6:]
    before, loaded, written, half_layer_mb, cache_mb = map(float, sizes)
    assert zero == "True" and cache_mb > 200
    assert loaded - before < cache_mb / 4, "loading made the whole cache resident"
    assert written - loaded > 0.9 * half_layer_mb, "writing half of one layer's keys did not grow RSS"
