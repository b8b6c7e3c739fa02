"""Prefix caching (specd/engine/block_manager.py): shared, reference-counted KV blocks by content.

The block manager alone: hits, sharing, rollback past shared blocks, LRU eviction, no leak.
The engine in bfloat16: greedy output with the cache on equals the cache off, for plain decoding
and every drafting method, on conversations whose turns resend their history and on prompts
sharing a system prompt, in mixed batches, with preemption forced by a tiny KV cache; and 1,000
requests with cancellations leave every block free or cached, none twice.
"""
from __future__ import annotations

import random

import pytest

from drafter_helpers import perturbed_copy
from head_layouts import head_target, write_layout
from specd import SamplingParams
from specd.engine.block_manager import BlockManager, block_hashes
from specd.engine.sequence import Sequence

transformers = pytest.importorskip("transformers")
BS = 16


def _seq(tokens: list[int]) -> Sequence:
    return Sequence(tokens, SamplingParams())


def _admit(bm: BlockManager, seq: Sequence) -> int:
    """Admit seq as the scheduler does; compute all its tokens; cache its full blocks. -> hit tokens."""
    prefix = bm.match_prefix(seq)
    assert bm.allocate(seq, len(seq), prefix)
    hit = seq.num_computed_tokens
    seq.num_computed_tokens = len(seq)
    bm.commit(seq)
    return hit


def _check_accounting(bm: BlockManager) -> None:
    """Every block is exactly one of: held (ref > 0), free, cached-unheld; none listed twice."""
    free, evictable = list(bm._free), list(bm._evictable)
    assert len(free) == len(set(free)) and not set(free) & set(evictable)
    held = {b for b in range(bm.num_total_blocks) if bm._refs[b] > 0}
    assert not held & (set(free) | set(evictable))
    assert len(held) + len(free) + len(evictable) == bm.num_total_blocks
    assert all(r >= 0 for r in bm._refs)


def test_hashes_chain_the_whole_prefix():
    a = block_hashes(list(range(48)), BS)
    b = block_hashes([99] + list(range(1, 48)), BS)
    assert len(a) == 3 and a[0] != b[0] and a[1] != b[1]  # same block tokens, other prefix: other hash
    assert block_hashes(list(range(40)), BS) == a[:2]
    assert block_hashes(list(range(16, 48)), BS, salt=a[0]) == a[1:]  # a chain extended from its last hash
    assert block_hashes(list(range(48)), BS, salt=b"other model") != a


def test_shared_blocks_are_counted_kept_and_never_freed_by_rollback():
    bm = BlockManager(12, BS, enable_prefix_caching=True)
    system = list(range(3, 3 + 40))  # 2 full blocks + 8 tokens
    first = _seq(system + [100, 101])
    assert _admit(bm, first) == 0
    second = _seq(system + [200, 201, 202])
    prefix = bm.match_prefix(second)
    assert prefix == first.block_table[:2]
    assert bm.allocate(second, len(second), prefix) and second.num_computed_tokens == 32
    assert [bm._refs[b] for b in prefix] == [2, 2]
    second.num_computed_tokens = len(second)
    bm.truncate(second, 33)  # a rollback never reaches below the committed tokens
    assert second.block_table[:2] == prefix and [bm._refs[b] for b in prefix] == [2, 2]
    bm.free(first)
    bm.free(second)
    _check_accounting(bm)
    assert bm.num_free_blocks == 12 and bm.num_cached_blocks == 2
    assert bm.stats.queries == 42 + 43 and bm.stats.hits == 32


def test_a_whole_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    prompt = list(range(3, 3 + 32))
    _admit(bm, _seq(prompt + [7]))
    again = _seq(prompt)  # its 2 blocks are cached: only the first is used, 16 tokens left to compute
    assert len(bm.match_prefix(again)) == 1


def test_eviction_takes_free_blocks_first_then_the_least_recently_released():
    bm = BlockManager(6, BS, enable_prefix_caching=True)
    evicted = []
    bm.on_evict = evicted.append
    old, new = _seq(list(range(3, 35))), _seq(list(range(50, 82)))  # 2 full blocks each
    _admit(bm, old)
    old_blocks = list(old.block_table)
    bm.free(old)
    _admit(bm, new)
    bm.free(new)
    assert bm.num_cached_blocks == 4 and len(bm._free) == 2
    taker = _seq(list(range(200, 260)))  # 4 blocks: the 2 free ones, then old's (released first)
    assert bm.allocate(taker, len(taker))
    assert sorted(evicted) == sorted(old_blocks)
    assert bm.stats.evictions == 2 and len(bm.match_prefix(_seq(list(range(50, 82)) + [1]))) == 2
    assert bm.match_prefix(_seq(list(range(3, 35)) + [1])) == []
    bm.free(taker)  # never committed: its blocks go back free, not cached
    assert bm.reset_prefix_cache() == 2 and bm.num_cached_blocks == 0
    _check_accounting(bm)


def test_off_means_no_hashing_and_no_hits():
    bm = BlockManager(8, BS)
    prompt = list(range(3, 40))
    _admit(bm, _seq(prompt))
    assert bm.match_prefix(_seq(prompt)) == [] and bm.num_cached_blocks == 0


# -- the engine ----------------------------------------------------------------------------------
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def target(model_dirs) -> str:
    return model_dirs["llama3"]


@pytest.fixture(scope="module")
def drafter(target, tmp_path_factory) -> str:
    return perturbed_copy(target, tmp_path_factory.mktemp("pc-drafter"), scale=0.03)


def _methods(drafter: str) -> dict[str, dict | None]:
    return {
        "plain": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "ngram_tree": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                       "prompt_lookup_max": 3, "tree": {"branching": [3]}},
        "suffix": {"method": "suffix", "num_speculative_tokens": 4},
        "draft_model": {"method": "draft_model", "model": drafter, "num_speculative_tokens": 4},
    }


def _conversations(llm, make_prompts, vocab: int, n: int, seed: int) -> tuple[list[list[int]], int]:
    """Two rounds: first turns (a shared system prompt + a question, and a few standalone prompts,
    mixed lengths, one batch), then second turns (each first turn + its answer + a new question).
    Returns every output token list and the tokens the prefix cache served."""
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(37)]
    questions = make_prompts(n, seed=seed, vocab=vocab, max_len=20)
    first = [system + q if i % 3 else q * 2 for i, q in enumerate(questions)]  # repeats: n-gram matches
    outs = [o.token_ids for o in llm.generate(first, GREEDY)]
    second = [p + o + [rng.randrange(3, vocab) for _ in range(5)] for p, o in zip(first, outs)]
    outs += [o.token_ids for o in llm.generate(second, GREEDY)]
    return outs, llm.engine.block_manager.stats.hits


@pytest.mark.parametrize("method", ["plain", "ngram", "ngram_tree", "suffix", "draft_model"])
@pytest.mark.parametrize("num_kv_blocks", [None, 14])  # 14 blocks: preemption and eviction forced
def test_greedy_identical_with_the_cache_on_and_off(method, num_kv_blocks, target, drafter, get_llm, make_prompts):
    spec = _methods(drafter)[method]
    kw = dict(dtype="bfloat16", speculative_config=spec, max_model_len=160, num_kv_blocks=num_kv_blocks)
    off, _ = _conversations(get_llm(target, fresh=True, enable_prefix_caching=False, **kw), make_prompts, 512, 12, 3)
    llm = get_llm(target, fresh=True, enable_prefix_caching=True, **kw)
    on, hits = _conversations(llm, make_prompts, 512, 12, 3)
    assert on == off
    assert hits > 0, "nothing came from the cache: the test would prove nothing"
    if num_kv_blocks:
        assert llm.engine.num_preemptions > 0 and llm.engine.block_manager.stats.evictions > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks
    _check_accounting(bm)


@pytest.fixture(scope="module")
def head_target_dir(tmp_path_factory):
    return head_target(tmp_path_factory.mktemp("pc-head-target"), max_positions=160)


@pytest.mark.parametrize("layout", ["eagle", "eagle3", "medusa_st", "mlp"])
@pytest.mark.parametrize("num_kv_blocks", [None, 14])  # 14 blocks: preemption and eviction forced
def test_hidden_state_heads_get_their_features_on_a_hit(layout, num_kv_blocks, head_target_dir, get_llm, make_prompts,
                                                       tmp_path):
    """A hit gives the sequence the cached blocks' feature rows too: the head drafts from the first
    step, and the tokens equal the cache off (EAGLE heads also restore their own KV of turn 1)."""
    target_dir, model = head_target_dir
    method, head_dir, _ = write_layout(layout, tmp_path / layout, model)
    spec = {"method": method, "model": str(head_dir), "target_model": target_dir, "num_speculative_tokens": 3,
            "adaptive": False}
    kw = dict(dtype="bfloat16", speculative_config=spec, max_model_len=160, num_kv_blocks=num_kv_blocks)
    off, _ = _conversations(get_llm(target_dir, fresh=True, enable_prefix_caching=False, **kw), make_prompts, 96, 6, 4)
    llm = get_llm(target_dir, fresh=True, **kw)
    on, hits = _conversations(llm, make_prompts, 96, 6, 4)
    assert on == off and hits > 0
    assert llm.engine.scheduler._block_features, "no feature rows were kept beside cached blocks"
    if num_kv_blocks:
        assert llm.engine.num_preemptions > 0 and llm.engine.block_manager.stats.evictions > 0
    head_cache = llm.engine.speculator.proposer.prefix_cache
    assert head_cache is None or head_cache.pairs_reused > 0, "the head never started from its own cache"


def test_a_thousand_requests_with_cancellations_leak_no_block(target, get_llm):
    """Random arrivals over a few shared prefixes, with aborts of waiting and running sequences,
    speculation on, a cache small enough to preempt and evict: at the end every block is free or
    cached and unheld, none listed twice; resetting the cache frees them all."""
    llm = get_llm(target, fresh=True, dtype="bfloat16", num_kv_blocks=24, max_model_len=128, max_num_seqs=16,
                  speculative_config=_methods("")["ngram"])
    engine, rng = llm.engine, random.Random(7)
    prefixes = [[rng.randrange(3, 512) for _ in range(rng.randrange(8, 50))] for _ in range(5)]
    added = aborted = 0
    while added < 1000 or engine.has_unfinished():
        for _ in range(rng.randrange(0, 6) if added < 1000 else 0):
            prompt = rng.choice(prefixes) + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 12))]
            engine.add_request(prompt, SamplingParams(max_tokens=rng.randrange(1, 10), temperature=0, ignore_eos=True))
            added += 1
        engine.step()
        for seq_id in list(engine.sequences):
            if rng.random() < 0.03:
                engine.abort(seq_id)
                aborted += 1
        _check_accounting(engine.block_manager)
    bm = engine.block_manager
    assert aborted > 20 and engine.num_preemptions > 0 and bm.stats.hits > 0 and bm.stats.evictions > 0
    assert bm.num_free_blocks == bm.num_total_blocks and not any(bm._refs)
    bm.reset_prefix_cache()
    assert len(bm._free) == bm.num_total_blocks and bm.num_cached_blocks == 0
