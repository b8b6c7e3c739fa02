"""Paged KV cache end to end: blocks come back, preemption and chunked prefill are exact.

Each test builds its own engine (fresh=True) because it inspects block counters and
preemption counts. Expected outputs come from transformers (greedy, float32), so a
scheduling bug that corrupts the cache shows up as a token mismatch.
"""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(300)

MAX_NEW = 24
BLOCK = 16
MAX_LEN = 160  # longest prompt (100) + MAX_NEW fits in 8 blocks of 16


@pytest.fixture(scope="module")
def prompts(make_prompts):
    return make_prompts(16, seed=77)


@pytest.fixture(scope="module")
def ref(llama_dir, prompts, hf_greedy):
    return [hf_greedy(llama_dir, p, MAX_NEW) for p in prompts]


def _greedy(max_tokens=MAX_NEW):
    from specd import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _all_free(llm) -> bool:
    bm = llm.engine.block_manager
    return bm.num_free_blocks == bm.num_total_blocks


def _check_outputs(outs, prompts, ref, first_divergence, what):
    assert len(outs) == len(prompts)
    for i, (o, p, r) in enumerate(zip(outs, prompts, ref)):
        assert list(o.prompt_token_ids) == p
        assert list(o.token_ids) == r, f"{what}, prompt {i} (len {len(p)}): {first_divergence(o.token_ids, r)}"


def test_blocks_free_after_finish(llama_dir, prompts, ref, get_llm, first_divergence):
    llm = get_llm(llama_dir, fresh=True, block_size=BLOCK, num_kv_blocks=128, max_model_len=MAX_LEN)
    bm = llm.engine.block_manager
    assert bm.num_total_blocks == 128
    assert _all_free(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy())
    _check_outputs(outs, prompts, ref, first_divergence, "roomy cache")
    assert _all_free(llm)
    assert not llm.engine.has_unfinished()
    # and again, with mixed lengths of output (requests finishing at different steps)
    from specd import SamplingParams

    params = [SamplingParams(max_tokens=1 + i, temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for i, (o, r) in enumerate(zip(outs, ref)):
        assert list(o.token_ids) == r[: 1 + i]
    assert _all_free(llm)


def test_blocks_in_use_while_running_and_free_after_abort(llama_dir, prompts, get_llm):
    llm = get_llm(llama_dir, fresh=True, block_size=BLOCK, num_kv_blocks=128, max_model_len=MAX_LEN)
    eng = llm.engine
    total = eng.block_manager.num_total_blocks
    ids = [eng.add_request(list(p), _greedy(max_tokens=MAX_NEW)) for p in prompts[:8]]
    assert len(set(ids)) == 8 and all(isinstance(i, int) for i in ids)
    finished = []
    for _ in range(3):
        finished += eng.step()
    assert eng.has_unfinished()
    assert eng.block_manager.num_free_blocks < total, "running sequences hold no KV blocks?"
    # abort half mid-generation; the rest run to completion
    for sid in ids[::2]:
        eng.abort(sid)
    guard = 0
    while eng.has_unfinished():
        finished += eng.step()
        guard += 1
        assert guard < 500, "engine never finished after abort"
    assert eng.block_manager.num_free_blocks == total
    done = {s.seq_id: s for s in finished}
    for sid in ids[1::2]:
        assert sid in done and done[sid].finish_reason == "length"
        assert len(done[sid].output_token_ids) == MAX_NEW
    for sid in ids[::2]:
        if sid in done:  # an engine may or may not report aborted sequences
            assert done[sid].finish_reason == "abort"


def test_abort_everything(llama_dir, prompts, get_llm):
    llm = get_llm(llama_dir, fresh=True, block_size=BLOCK, num_kv_blocks=16, max_model_len=MAX_LEN)
    eng = llm.engine
    total = eng.block_manager.num_total_blocks
    # more work than the cache holds: some requests are waiting, some running
    ids = [eng.add_request(list(p), _greedy(max_tokens=MAX_NEW)) for p in prompts]
    eng.step()
    eng.step()
    for sid in ids:
        eng.abort(sid)
    # after aborting everything, at most a step is needed to settle
    for _ in range(3):
        if not eng.has_unfinished():
            break
        eng.step()
    assert not eng.has_unfinished()
    assert eng.block_manager.num_free_blocks == total
    # the engine is still usable afterwards
    (out,) = llm.generate({"prompt_token_ids": prompts[0]}, _greedy(4))
    assert len(out.token_ids) == 4
    assert eng.block_manager.num_free_blocks == total


def test_abort_before_first_step(llama_dir, prompts, get_llm):
    llm = get_llm(llama_dir, fresh=True, block_size=BLOCK, num_kv_blocks=64, max_model_len=MAX_LEN)
    eng = llm.engine
    sid = eng.add_request(list(prompts[0]), _greedy())
    eng.abort(sid)
    for _ in range(2):
        if eng.has_unfinished():
            eng.step()
    assert not eng.has_unfinished()
    assert _all_free(llm)


@pytest.mark.parametrize("block_size", [4, 16])
def test_tiny_kv_budget_preempts_and_stays_exact(block_size, llama_dir, prompts, ref, get_llm, first_divergence):
    # just enough blocks for one longest sequence (+1): 16 requests must take turns
    num_blocks = -(-MAX_LEN // block_size) + 1
    llm = get_llm(llama_dir, fresh=True, block_size=block_size, num_kv_blocks=num_blocks, max_model_len=MAX_LEN)
    assert llm.engine.block_manager.num_total_blocks == num_blocks
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy())
    _check_outputs(outs, prompts, ref, first_divergence, f"tiny cache ({num_blocks} blocks of {block_size})")
    assert all(o.finish_reason == "length" for o in outs)
    assert llm.engine.num_preemptions > 0, "the tiny budget should have forced preemption"
    assert _all_free(llm)


def test_preemption_with_long_generations(llama_dir, make_prompts, get_llm, hf_greedy, first_divergence):
    """Sequences that grow into the shortage mid-decode (not only at admission) are preempted and recomputed."""
    prompts = make_prompts(6, seed=5, lengths=[20, 3, 40, 9, 17, 33])
    new = 60
    ref = [hf_greedy(llama_dir, p, new) for p in prompts]
    llm = get_llm(llama_dir, fresh=True, block_size=8, num_kv_blocks=14, max_model_len=104)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(new))
    _check_outputs(outs, prompts, ref, first_divergence, "decode-time preemption")
    assert llm.engine.num_preemptions > 0
    assert _all_free(llm)


@pytest.mark.parametrize("budget", [7, 16])
def test_chunked_prefill_tiny_token_budget(budget, llama_dir, prompts, ref, get_llm, first_divergence):
    llm = get_llm(llama_dir, fresh=True, block_size=BLOCK, max_model_len=MAX_LEN,
                  max_num_batched_tokens=budget, enable_chunked_prefill=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy())
    _check_outputs(outs, prompts, ref, first_divergence, f"chunked prefill, budget {budget}")
    assert _all_free(llm)


def test_max_num_seqs_limits_batch(llama_dir, prompts, ref, get_llm, first_divergence):
    llm = get_llm(llama_dir, fresh=True, max_model_len=MAX_LEN, max_num_seqs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy())
    _check_outputs(outs, prompts, ref, first_divergence, "max_num_seqs=3")


def test_no_chunked_prefill(llama_dir, prompts, ref, get_llm, first_divergence):
    llm = get_llm(llama_dir, fresh=True, max_model_len=MAX_LEN, enable_chunked_prefill=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy())
    _check_outputs(outs, prompts, ref, first_divergence, "chunked prefill off")


def test_prompt_longer_than_max_model_len_raises(llama_dir, get_llm):
    llm = get_llm(llama_dir, fresh=True, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len|max-model-len|too long"):
        llm.generate([5] * 33, _greedy(4))
    # the engine is not left with a half-added request
    assert not llm.engine.has_unfinished()
    assert _all_free(llm)
    (out,) = llm.generate([5] * 8, _greedy(4))
    assert len(out.token_ids) == 4


def test_generation_capped_by_max_model_len(llama_dir, get_llm):
    """A prompt that fits but leaves less room than max_tokens: either rejected up front or cut at max_model_len."""
    llm = get_llm(llama_dir, fresh=True, max_model_len=32)
    try:
        (out,) = llm.generate([5] * 28, _greedy(16))
    except ValueError:
        return
    assert len(out.prompt_token_ids) + len(out.token_ids) <= 32
    assert out.finish_reason == "length"
    assert _all_free(llm)


def test_seeded_sampling_survives_preemption(llama_dir, prompts, get_llm):
    """Preemption by recompute keeps the tokens already sampled and the seeded streams."""
    from specd import SamplingParams

    params = [SamplingParams(max_tokens=MAX_NEW, temperature=1.0, seed=500 + i, ignore_eos=True)
              for i in range(len(prompts))]
    reqs = [{"prompt_token_ids": p} for p in prompts]
    roomy = get_llm(llama_dir, fresh=True, block_size=BLOCK, num_kv_blocks=256, max_model_len=MAX_LEN)
    tiny = get_llm(llama_dir, fresh=True, block_size=BLOCK, num_kv_blocks=-(-MAX_LEN // BLOCK) + 1,
                   max_model_len=MAX_LEN)
    a = roomy.generate(reqs, params)
    b = tiny.generate(reqs, params)
    assert tiny.engine.num_preemptions > 0
    for i, (x, y) in enumerate(zip(a, b)):
        assert list(x.token_ids) == list(y.token_ids), f"prompt {i}"
    assert _all_free(tiny)
