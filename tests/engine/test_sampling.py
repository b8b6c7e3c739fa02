"""Sampling end to end: per-request seeds, filters, the sampled distribution, logprobs.

The distribution checks sample the first new token many times (max_tokens=1, one
request per sample) and compare the counts with the distribution computed from
transformers' logits by a chi-square goodness-of-fit test. scipy is not a dependency,
so the critical value comes from the Wilson-Hilferty approximation of the chi-square
quantile (accurate to well under 1% for df >= 3). Samples are seeded, so the
outcome is deterministic: a pass is not luck that can change from run to run.
"""
from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.timeout(300)

PROMPT = [17, 230, 5, 99, 401, 64, 12, 300, 7, 250]
Z_1E4 = 3.719  # one-sided standard normal quantile for alpha = 1e-4


def _sp(**kw):
    from specd import SamplingParams

    kw.setdefault("ignore_eos", True)
    return SamplingParams(**kw)


def chi2_critical(df: int, z: float = Z_1E4) -> float:
    """Wilson-Hilferty approximation of the chi-square upper quantile."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2_statistic(counts: dict[int, int], probs: torch.Tensor, n: int, min_expected: float = 5.0):
    """Pearson statistic over tokens with expected count >= min_expected; the rest pooled.

    A sample of a token with probability 0 is returned as an infinite statistic.
    Returns (statistic, degrees of freedom).
    """
    expected = probs.double() * n
    for tok, c in counts.items():
        if probs[tok] == 0 and c > 0:
            return math.inf, 1
    big = (expected >= min_expected).nonzero().flatten().tolist()
    stat, pooled_obs, pooled_exp = 0.0, 0, 0.0
    big_set = set(big)
    for tok in big:
        o, e = counts.get(tok, 0), expected[tok].item()
        stat += (o - e) ** 2 / e
    pooled_obs = sum(c for t, c in counts.items() if t not in big_set)
    pooled_exp = n - sum(expected[t].item() for t in big)
    bins = len(big)
    if pooled_exp >= 1.0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        bins += 1
    return stat, max(bins - 1, 1)


@pytest.fixture(scope="module")
def llm(llama_dir, get_llm):
    return get_llm(llama_dir)


@pytest.fixture(scope="module")
def logits(llama_dir, hf_logits):
    """HF next-token logits after PROMPT, float64 for the reference distributions."""
    return hf_logits(llama_dir, PROMPT)[-1].double()


def _sample_first_tokens(llm, n: int, seed0: int, **params) -> dict[int, int]:
    reqs = [{"prompt_token_ids": PROMPT}] * n
    outs = llm.generate(reqs, [_sp(max_tokens=1, seed=seed0 + i, **params) for i in range(n)])
    counts: dict[int, int] = {}
    for o in outs:
        assert len(o.token_ids) == 1
        counts[o.token_ids[0]] = counts.get(o.token_ids[0], 0) + 1
    return counts


def _top_k_probs(logits, k):
    p = torch.softmax(logits, -1)
    keep = torch.zeros_like(p, dtype=torch.bool)
    keep[p.topk(k).indices] = True
    p = torch.where(keep, p, 0.0)
    return p / p.sum()


def _safe_top_p(logits, target):
    """A top_p near target that lies halfway between two cumulative masses (no boundary ties)."""
    sp = torch.softmax(logits, -1).sort(descending=True).values
    cum = sp.cumsum(0)
    i = int((cum < target).sum())
    return float((cum[i - 1] + cum[i]) / 2) if i > 0 else float(cum[0] / 2)


def _top_p_probs(logits, top_p):
    p = torch.softmax(logits, -1)
    sp, idx = p.sort(descending=True)
    before = sp.cumsum(0) - sp  # mass of strictly more likely tokens
    keep_sorted = before < top_p
    keep = torch.zeros_like(p, dtype=torch.bool)
    keep[idx[keep_sorted]] = True
    p = torch.where(keep, p, 0.0)
    return p / p.sum()


def _safe_min_p(logits, target):
    """A min_p near target halfway between two probability ratios p/p_max (no boundary ties)."""
    r = torch.softmax(logits, -1)
    r = (r / r.max()).sort(descending=True).values
    i = int((r >= target).sum())
    return float((r[i - 1] + r[i]) / 2)


def _min_p_probs(logits, min_p):
    p = torch.softmax(logits, -1)
    keep = p >= min_p * p.max()
    p = torch.where(keep, p, 0.0)
    return p / p.sum()


# ------------------------------------------------------------------ seeds


def test_seeded_request_independent_of_batch(llm, make_prompts):
    others = make_prompts(8, seed=3)
    target = {"prompt_token_ids": PROMPT}
    for target_params in (_sp(max_tokens=24, temperature=1.0, seed=1234),
                          _sp(max_tokens=24, temperature=0.8, top_k=50, top_p=0.9, seed=99)):
        (alone,) = llm.generate(target, target_params)
        # 4 seeded and 4 unseeded neighbours with assorted settings and lengths
        other_params = [
            _sp(max_tokens=24, temperature=1.0, seed=7),
            _sp(max_tokens=5, temperature=0.0),
            _sp(max_tokens=30, temperature=1.3),
            _sp(max_tokens=24, temperature=0.7, top_k=10, seed=8),
            _sp(max_tokens=12, temperature=1.0, top_p=0.5),
            _sp(max_tokens=24, temperature=1.0, seed=1234),  # same seed, other prompt
            _sp(max_tokens=3, temperature=1.0, min_p=0.1),
            _sp(max_tokens=24, temperature=1.0, seed=1235),
        ]
        for pos in (0, 4, 8):
            reqs = [{"prompt_token_ids": p} for p in others]
            params = list(other_params)
            reqs.insert(pos, target)
            params.insert(pos, target_params)
            outs = llm.generate(reqs, params)
            assert list(outs[pos].token_ids) == list(alone.token_ids), f"target at position {pos}"
        # and twice in one batch: both copies equal the lone run
        outs = llm.generate([target, {"prompt_token_ids": others[0]}, target], [target_params, other_params[2], target_params])
        assert list(outs[0].token_ids) == list(alone.token_ids)
        assert list(outs[2].token_ids) == list(alone.token_ids)


def test_seeded_request_independent_of_chunking(llama_dir, llm, get_llm):
    """Scheduling differences (tiny token budget, few seqs) do not change a seeded request."""
    p = _sp(max_tokens=20, temperature=1.0, seed=4321)
    (ref,) = llm.generate({"prompt_token_ids": PROMPT}, p)
    small = get_llm(llama_dir, max_num_batched_tokens=4, max_num_seqs=2)
    outs = small.generate([{"prompt_token_ids": PROMPT}, [5] * 30, [6] * 3], [p, _sp(max_tokens=8), _sp(max_tokens=20)])
    assert list(outs[0].token_ids) == list(ref.token_ids)


def test_different_seeds_differ(llm):
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * 4, [_sp(max_tokens=24, seed=s) for s in (1, 2, 3, 4)])
    seqs = {tuple(o.token_ids) for o in outs}
    assert len(seqs) == 4


def test_same_seed_repeatable(llm):
    p = _sp(max_tokens=24, seed=5)
    a = llm.generate({"prompt_token_ids": PROMPT}, p)[0].token_ids
    b = llm.generate({"prompt_token_ids": PROMPT}, p)[0].token_ids
    assert list(a) == list(b)


# ------------------------------------------------------------------ filters that reduce to greedy


@pytest.mark.parametrize("params", [dict(top_k=1), dict(min_p=1.0), dict(top_p=1e-9), dict(top_k=1, temperature=5.0)],
                         ids=["top_k=1", "min_p=1", "top_p=tiny", "top_k=1,T=5"])
def test_degenerate_filters_equal_greedy(params, llm, make_prompts):
    prompts = [{"prompt_token_ids": p} for p in make_prompts(6, seed=11)]
    greedy = llm.generate(prompts, _sp(max_tokens=16, temperature=0.0))
    kw = dict(temperature=1.0, max_tokens=16)
    kw.update(params)
    sampled = llm.generate(prompts, [_sp(seed=i, **kw) for i in range(len(prompts))])
    for g, s in zip(greedy, sampled):
        assert list(s.token_ids) == list(g.token_ids)


# ------------------------------------------------------------------ sampled distributions


def _assert_matches(counts, probs, n, what):
    outside = {t: c for t, c in counts.items() if probs[t] == 0}
    assert not outside, f"{what}: sampled tokens outside the allowed set: {outside}"
    stat, df = chi2_statistic(counts, probs, n)
    crit = chi2_critical(df)
    assert stat < crit, f"{what}: chi2={stat:.1f} >= critical {crit:.1f} (df={df}, alpha=1e-4)"
    return stat, df


def test_temperature_1_frequencies_match_softmax(llm, logits):
    n = 3000
    counts = _sample_first_tokens(llm, n, seed0=10_000, temperature=1.0)
    probs = torch.softmax(logits, -1)
    _assert_matches(counts, probs, n, "T=1")
    # power check: the same samples are rejected against a visibly different temperature
    wrong = torch.softmax(logits / 0.7, -1)
    stat, df = chi2_statistic(counts, wrong, n)
    assert stat > chi2_critical(df), "test too weak to tell T=1 from T=0.7"


def test_temperature_scales_distribution(llm, logits):
    n = 2000
    counts = _sample_first_tokens(llm, n, seed0=20_000, temperature=0.6)
    _assert_matches(counts, torch.softmax(logits / 0.6, -1), n, "T=0.6")


def test_top_k_distribution(llm, logits):
    n = 1500
    counts = _sample_first_tokens(llm, n, seed0=30_000, temperature=1.0, top_k=8)
    assert len(counts) > 1
    _assert_matches(counts, _top_k_probs(logits, 8), n, "top_k=8")


def test_top_p_distribution(llm, logits):
    n = 1500
    top_p = _safe_top_p(logits, 0.5)
    counts = _sample_first_tokens(llm, n, seed0=40_000, temperature=1.0, top_p=top_p)
    assert len(counts) > 1
    _assert_matches(counts, _top_p_probs(logits, top_p), n, f"top_p={top_p:.4f}")


def test_min_p_distribution(llm, logits):
    n = 1500
    min_p = _safe_min_p(logits, 0.3)
    counts = _sample_first_tokens(llm, n, seed0=50_000, temperature=1.0, min_p=min_p)
    assert len(counts) > 1
    _assert_matches(counts, _min_p_probs(logits, min_p), n, f"min_p={min_p:.4f}")


# ------------------------------------------------------------------ logprobs


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_match_hf_log_softmax(temperature, llama_dir, llm, make_prompts, hf_logits):
    prompts = make_prompts(4, seed=21, lengths=[1, 17, 40, 5])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [_sp(max_tokens=12, temperature=temperature, seed=i, logprobs=True) for i in range(4)])
    for p, o in zip(prompts, outs):
        assert o.logprobs is not None and len(o.logprobs) == len(o.token_ids) == 12
        toks = list(o.token_ids)
        ref = torch.log_softmax(hf_logits(llama_dir, p + toks).double(), -1)
        expect = [ref[len(p) - 1 + i, t].item() for i, t in enumerate(toks)]
        got = [float(x) for x in o.logprobs]
        assert max(abs(a - b) for a, b in zip(got, expect)) <= 1e-4, (got, expect)
        if temperature == 0.0:  # the greedy token is the argmax
            assert all(ref[len(p) - 1 + i].argmax().item() == t for i, t in enumerate(toks))


def test_logprobs_off_by_default(llm):
    (o,) = llm.generate({"prompt_token_ids": PROMPT}, _sp(max_tokens=3))
    assert o.logprobs is None
