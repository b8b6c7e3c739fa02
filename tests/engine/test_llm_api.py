"""specd.LLM / engine API: clear errors in-process, continuous batching, block sizes, dtypes, CUDA."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.timeout(300)

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def _greedy(max_tokens=16, **kw):
    from specd import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


# ------------------------------------------------------------------ errors


def test_unknown_model_path(tmp_path):
    from specd import LLM

    missing = tmp_path / "definitely_missing_model"
    with pytest.raises((FileNotFoundError, ValueError), match="definitely_missing_model"):
        LLM(str(missing))


def test_dir_without_config(tmp_path):
    from specd import LLM

    (tmp_path / "empty").mkdir()
    with pytest.raises((FileNotFoundError, ValueError), match="config.json|empty"):
        LLM(str(tmp_path / "empty"))


def test_unsupported_architecture_names_it_and_lists_supported(unsupported_model_dir):
    from specd import LLM

    with pytest.raises(ValueError) as exc:
        LLM(unsupported_model_dir)
    msg = str(exc.value)
    assert "GPT2LMHeadModel" in msg
    for arch in SUPPORTED:
        assert arch in msg


@pytest.mark.parametrize("kwargs,field", [
    (dict(block_size=0), "block_size"),
    (dict(num_kv_blocks=0), "num_kv_blocks"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_model_len=0), "max_model_len"),
    (dict(max_model_len=10_000), "max_model_len"),  # above max_position_embeddings (256)
    (dict(dtype="float8"), "dtype"),
    (dict(device="tpu"), "device"),
])
def test_bad_engine_settings(kwargs, field, llama_dir):
    from specd import LLM

    with pytest.raises(ValueError, match=field):
        LLM(llama_dir, **kwargs)


def test_kv_budget_too_small_for_one_sequence(llama_dir):
    from specd import LLM

    with pytest.raises(ValueError):
        LLM(llama_dir, num_kv_blocks=1, block_size=16, max_model_len=128)


def test_max_model_len_is_fitted_to_the_kv_cache_unless_given(llama_dir, caplog):
    """The model's 256 positions do not fit 4 blocks of 16: unasked, max_model_len becomes 64 (a
    log line says so) and serves; a prompt past it gets the usual error."""
    from specd import LLM, SamplingParams

    with caplog.at_level("WARNING", logger="specd.engine.llm_engine"):
        llm = LLM(llama_dir, num_kv_blocks=4, block_size=16)
    assert llm.engine.max_model_len == 64 and "max_model_len lowered from the model's 256 to 64" in caplog.text
    (out,) = llm.generate([{"prompt_token_ids": list(range(5, 55))}], SamplingParams(temperature=0, max_tokens=30))
    assert len(out.token_ids) == 64 - 50 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len is 64"):
        llm.generate([{"prompt_token_ids": list(range(5, 75))}])


def test_available_memory_is_what_the_kernel_reports():
    from specd.engine.kv_memory import available_memory_bytes

    available = available_memory_bytes()
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    # (read a moment apart: other processes may have freed some memory in between)
    assert 0 < available <= min(info["MemAvailable"] + 256 * 2**20, info["MemTotal"])


def test_cpu_kv_cache_larger_than_the_memory_left_is_refused(llama_dir):
    """Its pages are taken only as blocks fill up, so it would not fail at start but kill the
    server later: refused at start, naming the sizes."""
    from specd import LLM
    from specd.engine.kv_memory import available_memory_bytes

    blocks = 4 * available_memory_bytes() // 4096  # a block of the tiny model holds >= 4 KB
    with pytest.raises(ValueError, match="does not fit in the .* GB of memory left"):
        LLM(llama_dir, num_kv_blocks=blocks, block_size=16)


def test_default_cpu_kv_cache_shrinks_to_the_memory_left(llama_dir, caplog, monkeypatch):
    """On a machine with little memory left (here: 64 KiB, as this process sees it) the default
    cache takes half of it, and the model's context is fitted to that (log lines say both)."""
    from specd import LLM
    from specd.engine import kv_memory
    from specd.engine.model_runner import ModelRunner

    monkeypatch.setattr(kv_memory, "available_memory_bytes", lambda: 64 * 1024)
    with caplog.at_level("WARNING"):
        llm = LLM(llama_dir, block_size=16)
    per_block = ModelRunner.kv_bytes_per_block(llm.engine.model, 16, llm.engine.dtype)
    assert llm.engine.block_manager.num_total_blocks == 32 * 1024 // per_block
    assert llm.engine.max_model_len == 16 * (32 * 1024 // per_block) < 256
    assert "of the 0.00 GB of memory left" in caplog.text and "max_model_len lowered" in caplog.text


@pytest.mark.parametrize("prompt", [[5, 512], [5, 10**6], [-1, 5], []], ids=["id=vocab", "huge id", "negative", "empty"])
def test_bad_prompt_ids(prompt, llama_dir, get_llm):
    llm = get_llm(llama_dir)
    with pytest.raises(ValueError):
        llm.generate({"prompt_token_ids": prompt}, _greedy(2))
    bm = llm.engine.block_manager
    assert not llm.engine.has_unfinished() and bm.num_free_blocks == bm.num_total_blocks


def test_bad_generate_arguments(llama_dir, get_llm):
    llm = get_llm(llama_dir)
    with pytest.raises(ValueError):
        llm.generate([], _greedy(2))
    with pytest.raises(ValueError):
        llm.generate([[5, 6], [7]], [_greedy(2)])  # 1 params for 2 prompts
    with pytest.raises(ValueError):
        llm.generate({"text": "w5"}, _greedy(2))


def test_text_prompt_without_tokenizer(model_dirs, get_llm):
    llm = get_llm(model_dirs["qwen2"])
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("hello", _greedy(2))


# ------------------------------------------------------------------ batching and block geometry


def test_continuous_batching_staggered_arrivals(llama_dir, make_prompts, get_llm, hf_greedy, first_divergence):
    """Requests that arrive while others are mid-decode join the running batch without disturbing it."""
    prompts = make_prompts(10, seed=99)
    new = 20
    llm = get_llm(llama_dir, fresh=True, max_num_batched_tokens=48)
    eng = llm.engine
    ids, finished, step = {}, {}, 0
    pending = list(enumerate(prompts))
    while pending or eng.has_unfinished():
        # one new request every other step
        if pending and step % 2 == 0:
            i, p = pending.pop(0)
            ids[eng.add_request(list(p), _greedy(new))] = i
        for seq in eng.step():
            finished[seq.seq_id] = seq
        step += 1
        assert step < 2000
    assert set(finished) == set(ids)
    for sid, i in ids.items():
        ref = hf_greedy(llama_dir, prompts[i], new)
        got = list(finished[sid].output_token_ids)
        assert got == ref, f"prompt {i}: {first_divergence(got, ref)}"
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks


@pytest.mark.parametrize("block_size", [1, 5, 32])
def test_block_sizes(block_size, model_dirs, make_prompts, get_llm, hf_greedy, first_divergence):
    d = model_dirs["qwen3"]  # head_dim != hidden/heads: catches KV layout slips
    prompts = make_prompts(8, seed=block_size)
    llm = get_llm(d, fresh=True, block_size=block_size, max_num_batched_tokens=37)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(20))
    for i, (o, p) in enumerate(zip(outs, prompts)):
        ref = hf_greedy(d, p, 20)
        assert list(o.token_ids) == ref, f"block_size {block_size}, prompt {i}: {first_divergence(o.token_ids, ref)}"


def test_long_sequence_to_max_position(model_dirs, get_llm, hf_greedy, first_divergence):
    """Up to max_position_embeddings (256), through llama3 rope scaling, in one sequence."""
    d = model_dirs["llama3"]
    prompt = list(range(3, 203))  # 200 tokens
    llm = get_llm(d)
    (o,) = llm.generate({"prompt_token_ids": prompt}, _greedy(56))
    ref = hf_greedy(d, prompt, 56)
    assert list(o.token_ids) == ref, first_divergence(o.token_ids, ref)


# ------------------------------------------------------------------ dtypes and devices


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_smoke(dtype, llama_dir, make_prompts, get_llm, hf_greedy):
    """Low precision runs and stays close to float32: most first tokens agree with the reference."""
    llm = get_llm(llama_dir, dtype=dtype)
    prompts = make_prompts(8, seed=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(8))
    agree = 0
    for o, p in zip(outs, prompts):
        assert len(o.token_ids) == 8 and all(0 <= t < 512 for t in o.token_ids)
        agree += o.token_ids[0] == hf_greedy(llama_dir, p, 8)[0]
    assert agree >= 5, f"only {agree}/8 first tokens agree with float32"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_greedy_matches_cpu(family_dir, make_prompts, get_llm, first_divergence):
    prompts = make_prompts(8, seed=8)
    cpu = get_llm(family_dir).generate([{"prompt_token_ids": p} for p in prompts], _greedy(16))
    gpu = get_llm(family_dir, device="cuda").generate([{"prompt_token_ids": p} for p in prompts], _greedy(16))
    for i, (a, b) in enumerate(zip(cpu, gpu)):
        assert list(a.token_ids) == list(b.token_ids), f"prompt {i}: {first_divergence(b.token_ids, a.token_ids)}"
