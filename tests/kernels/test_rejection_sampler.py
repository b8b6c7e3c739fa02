"""Batched rejection sampling: crafted greedy cases, exact target distribution, lossy modes.

The distribution tests run 3·10^5 one-step "requests" through ONE vectorised call and
chi-square-test each emitted position against the target distribution, at a false
alarm rate of 1e-6; a deliberately broken verification must fail the same test.
"""
from __future__ import annotations

import math

import pytest
import torch

from specd.engine.sampler import apply_sampling_filters
from specd.kernels.rejection_sampler import rejection_sample
from specd.sampling import SamplingParams

V = 8
TRIALS = 300_000


def chi2_critical(df: int, z: float = 4.753) -> float:
    """Wilson–Hilferty upper quantile of chi-square(df); z = 4.753 is a tail of 1e-6."""
    a = 2.0 / (9.0 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def chi2_stat(samples: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token with zero target probability"
    expected = probs[support].double() * samples.numel()
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


def _call(p_rows, drafts, num_draft, q_ids=None, q_probs=None, greedy=None, gen=None, mode="strict", **kw):
    B = num_draft.numel()
    gen = gen or torch.Generator().manual_seed(0)
    uniforms = torch.rand(drafts.numel(), generator=gen)
    noise = torch.empty(B, p_rows.shape[1]).exponential_(generator=gen)
    greedy = torch.zeros(B, dtype=torch.bool) if greedy is None else greedy
    return rejection_sample(p_rows, p_rows.log(), drafts, num_draft, q_ids, q_probs, greedy, uniforms, noise,
                            mode=mode, **kw)


def test_greedy_accepts_matching_prefix_then_replaces_or_adds_bonus():
    # argmax per row: seq 0 rows -> 3, 5, 1 (bonus row 1); seq 1 (no drafts) -> 6; seq 2 rows -> 2, 4
    argmaxes = [3, 5, 1, 6, 2, 4]
    logits = torch.full((6, V), -5.0)
    logits[torch.arange(6), torch.tensor(argmaxes)] = 5.0
    probs = logits.softmax(-1)
    drafts = torch.tensor([3, 5, 7])  # seq 0 drafts 3, 5 (both right); seq 2 drafts 7 (wrong)
    num_draft = torch.tensor([2, 0, 1])
    out, n_acc, lossy = rejection_sample(
        probs, logits, drafts, num_draft, None, None, torch.ones(3, dtype=torch.bool),
        torch.zeros(3), torch.ones(3, V))
    assert out.tolist() == [[3, 5, 1], [6, -1, -1], [2, -1, -1]]
    assert n_acc.tolist() == [2, 0, 0] and lossy is False


def _target(seed: int, top_p: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, V, generator=g) * 1.5
    return apply_sampling_filters(logits, [SamplingParams(temperature=1.0, top_p=top_p)] * 3)


def _sparse_q(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(V, generator=g)[:4] for _ in range(2)])  # [2 positions, K=4]
    probs = torch.rand(2, 4, generator=g) + 0.1
    return ids, probs / probs.sum(-1, keepdim=True)


def _one_step(p: torch.Tensor, sparse: bool, wrong_q: bool = False):
    """TRIALS sequences, 2 drafts each, same target rows; returns (out, num_accepted)."""
    g = torch.Generator().manual_seed(1)
    num_draft = torch.full((TRIALS,), 2)
    p_rows = p.repeat(TRIALS, 1)  # rows per sequence: p1, p2, bonus p3
    if sparse:
        ids, probs = _sparse_q(2)
        picks = torch.stack([torch.multinomial(probs[i], TRIALS, replacement=True, generator=g) for i in range(2)], 1)
        drafts = torch.gather(ids.T.expand(TRIALS, 4, 2), 1, picks[:, None, :])[:, 0, :].reshape(-1)  # x_i ~ q_i
        q_ids, q_probs = ids.repeat(TRIALS, 1), probs.repeat(TRIALS, 1)
        if wrong_q:  # a real bug: verify with a q other than the one the drafts came from
            q_probs = torch.full_like(q_probs, 0.25)
    else:  # a deterministic proposer: the drafts are a fixed function of the context
        drafts = torch.tensor([2, 5]).repeat(TRIALS)
        q_ids = q_probs = None
    out, n_acc, _ = _call(p_rows, drafts, num_draft, q_ids, q_probs, gen=g)
    return out, n_acc


@pytest.mark.parametrize("sparse", [False, True], ids=["one_hot_q", "sparse_q"])
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_emitted_tokens_follow_the_target(sparse, top_p):
    p = _target(0, top_p)
    out, n_acc = _one_step(p, sparse)
    stat, df = chi2_stat(out[:, 0], p[0])
    assert stat < chi2_critical(df), f"position 0: chi2 {stat:.1f} >= {chi2_critical(df):.1f}"
    # Given the first draft was accepted, the second emitted token is from p2 (accepted or recovered).
    second = out[n_acc >= 1, 1]
    assert second.numel() >= 100_000 or not sparse
    stat, df = chi2_stat(second, p[1])
    assert stat < chi2_critical(df), f"position 1: chi2 {stat:.1f} >= {chi2_critical(df):.1f}"


def test_the_distribution_test_catches_a_broken_verifier():
    p = _target(0)
    out, _ = _one_step(p, sparse=True, wrong_q=True)
    stat, df = chi2_stat(out[:, 0], p[0])
    assert stat > chi2_critical(df), "verifying with the wrong q must fail the distribution test"


def test_seeded_randomness_makes_each_row_independent_of_the_batch():
    p = _target(3).repeat(4, 1)  # 4 sequences x (2 drafts + bonus)
    drafts, num_draft = torch.tensor([1, 2, 3, 4, 5, 6, 7, 0]), torch.tensor([2, 2, 2, 2])

    def randomness(seeds):
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        u = torch.cat([torch.rand(2, generator=g) for g in gens])
        e = torch.stack([torch.empty(V).exponential_(generator=g) for g in gens])
        return u, e

    u, e = randomness([11, 12, 13, 14])
    full, _, _ = rejection_sample(p, p.log(), drafts, num_draft, None, None, torch.zeros(4, dtype=torch.bool), u, e)
    u1, e1 = randomness([13])
    alone, _, _ = rejection_sample(p[6:9], p[6:9].log(), drafts[4:6], num_draft[:1], None, None,
                                   torch.zeros(1, dtype=torch.bool), u1, e1)
    assert alone[0].tolist() == full[2].tolist()


def test_synthetic_mode_accepts_at_the_set_rate_and_is_flagged():
    p = _target(4)
    n = 100_000
    out, n_acc, lossy = _call(p[:2].repeat(n, 1), torch.tensor([7]).repeat(n), torch.ones(n, dtype=torch.long),
                              mode="synthetic", synthetic_acceptance_rate=0.3)
    rate = n_acc.double().mean().item()
    assert lossy and abs(rate - 0.3) < 5 * math.sqrt(0.3 * 0.7 / n)


def test_typical_mode_is_flagged_and_accepts_likely_tokens():
    p = torch.tensor([[0.9] + [0.1 / (V - 1)] * (V - 1)] * 2)
    out, n_acc, lossy = _call(p, torch.tensor([0]), torch.tensor([1]), mode="typical")
    assert lossy and n_acc.tolist() == [1]
    with pytest.raises(ValueError, match="mode"):
        _call(p, torch.tensor([0]), torch.tensor([1]), mode="bogus")
