"""The step's sampler alone: randomness drawn once and clamped, the target/rejection split."""
from __future__ import annotations

import torch

from specd.engine.sampler import Sampler, SamplingMetadata, inverse_cdf, make_generator
from specd.kernels import rejection_sampler as rs
from specd.sampling import SamplingParams
from chi2 import chi2_critical

CPU = torch.device("cpu")
V = 8
FILTERED = 5  # removed by top-k 2 below


def logits_rows(n: int) -> torch.Tensor:
    """[n, V]: tokens 0 and 1 most likely (kept by top-k 2), FILTERED third."""
    row = torch.tensor([2.0, 1.5, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    return row.expand(n, V).contiguous()


def zero_noise_on_filtered(monkeypatch):
    """Every Exp(1) draw gives 1, except exactly 0 on the FILTERED token."""
    def fake(shape, device, generator=None):
        noise = torch.ones(shape, device=device)
        noise[..., FILTERED] = 0.0
        return noise
    monkeypatch.setattr(rs, "exp_noise", fake)


def test_zero_noise_on_a_filtered_token_never_emits_it(monkeypatch):
    zero_noise_on_filtered(monkeypatch)
    probs = torch.tensor([[0.6, 0.4, 0, 0, 0, 0.0, 0, 0]])
    # Unclamped, p / E = 0 / 0 = NaN on the filtered token, and argmax picks NaN.
    assert rs.exponential_race(probs, rs.exp_noise((1, V), CPU))[0] == FILTERED
    # The race's rows (a GPU's) are clamped; a CPU draws uniforms for the inverse CDF instead.
    _, noise = rs.draw_randomness([None, make_generator(1, CPU)], [0, 0], V, CPU, race=True)
    assert noise.shape == (2, V) and bool((noise > 0).all())
    _, u = rs.draw_randomness([None, make_generator(1, CPU)], [0, 0], V, CPU)
    assert u.shape == (2,) and u.dtype == torch.float64
    for race, randomness in ((True, noise), (False, u)):  # the recovered draw, either way
        residual = torch.tensor([[0.0, 0.4, 0, 0, 0, 0.0, 0, 0]])
        assert rs.draw_from(residual, randomness[:1]).tolist() == [1], race


def test_the_sampler_never_emits_a_filtered_token():
    params = SamplingParams(temperature=1.0, top_k=2)
    sampler = Sampler(CPU)
    # Plain rows (one unseeded, one seeded) and a verify row whose draft is rejected
    # (draft 7 has p = 0), so the recovered draw is from the residual: tokens 0 and 1 only.
    meta = SamplingMetadata.build([params] * 3, CPU, [None, make_generator(3, CPU), None],
                                  drafts=[[], [], [7]])
    seen = set()
    for _ in range(40):
        out = sampler(logits_rows(4), meta)
        assert all(FILTERED not in tokens for tokens in out.token_ids), out
        assert out.token_ids[2][0] in (0, 1) and out.num_accepted == [0, 0, 0]
        seen.add(out.token_ids[2][0])
    assert seen == {0, 1}  # 0.6 / 0.4: both drawn in 40 tries but with probability ~1e-9


def test_a_step_without_drafts_consumes_what_a_plain_step_does():
    params = SamplingParams(temperature=0.8, seed=7)
    gen = make_generator(7, CPU)
    Sampler(CPU)(logits_rows(1), SamplingMetadata.build([params], CPU, [gen]))
    plain = make_generator(7, CPU)
    torch.rand(1, dtype=torch.float64, generator=plain)  # one uniform: the inverse CDF's point
    assert torch.equal(gen.get_state(), plain.get_state())
    # With k drafts: k uniforms first, then the one uniform shared by recovered and bonus
    # (on a CPU: the inverse CDF; a GPU's race draws a noise row instead).
    gen = make_generator(7, CPU)
    Sampler(CPU)(logits_rows(3), SamplingMetadata.build([params], CPU, [gen], drafts=[[0, 1]]))
    spec = make_generator(7, CPU)
    torch.rand(2, generator=spec)
    torch.rand(1, dtype=torch.float64, generator=spec)
    assert torch.equal(gen.get_state(), spec.get_state())


def test_cpu_noise_is_exp1():
    """The CPU's noise rows: positive, and Exp(1) by their mean, variance and tail (a uniform in
    float32 would put E = 0 on ~1 in 2^24 draws; none of 4M here may be 0 or inf)."""
    noise = rs.exp_noise((64, 65536), CPU, make_generator(0, CPU))
    assert noise.dtype == torch.float32 and bool((noise > 0).all()) and bool(torch.isfinite(noise).all())
    e = noise.double()
    n = e.numel()
    assert abs(e.mean().item() - 1) < 5 / n ** 0.5 and abs(e.var().item() - 1) < 10 / n ** 0.5
    for x in (0.01, 1.0, 5.0):  # P(E > x) = exp(-x)
        p = float(torch.tensor(-x).exp())
        assert abs((e > x).double().mean().item() - p) < 5 * (p * (1 - p) / n) ** 0.5


def test_inverse_cdf_never_draws_a_token_of_probability_zero():
    """At the ends too, u = 1 included (a point at the total would run the search past the last
    token that has mass); tokens of probability 0 first, between and last (a grammar's mask)."""
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0], [0.0, 0.0, 1e-30, 0.0, 0.0], [0.1, 0.0, 0.0, 0.0, 0.9]] * 4)
    u = torch.tensor([0.0] * 3 + [1 - 2**-53] * 3 + [1.0] * 3 + [0.5] * 3, dtype=torch.float64)
    tokens = inverse_cdf(probs, u)
    assert bool((probs[torch.arange(12), tokens] > 0).all()), tokens
    assert tokens.tolist() == [1, 2, 0, 3, 2, 4, 3, 2, 4, 3, 2, 4]


def test_inverse_cdf_draws_from_the_distribution():
    """A skewed 1000-token row (one token at half the mass, a tail 1e4 times smaller): chi-square
    over 200k draws, the tail tokens pooled."""
    g = torch.Generator().manual_seed(0)
    p = torch.rand(1000, generator=g) ** 8
    p[17] = p.sum()
    p = (p / p.sum()).float()
    n = 200_000
    tokens = inverse_cdf(p.expand(n, -1), torch.rand(n, dtype=torch.float64, generator=g))
    counts = torch.bincount(tokens, minlength=1000).double()
    expected = p.double() * n
    big = expected >= 20
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    stat = float(((obs - exp) ** 2 / exp).sum())
    assert stat < chi2_critical(len(obs) - 1), stat


def test_greedy_rows_draw_nothing():
    sampler = Sampler(CPU)
    before = sampler.default_generator.get_state()
    gen = make_generator(1, CPU)
    seeded_before = gen.get_state()
    out = sampler(logits_rows(4), SamplingMetadata.build([SamplingParams(temperature=0.0)] * 2, CPU, [None, gen],
                                                         drafts=[[0, 0], []]))
    assert out.token_ids == [[0, 0, 0], [0]] and out.num_accepted == [2, 0]  # argmax is 0 everywhere
    assert torch.equal(sampler.default_generator.get_state(), before)
    assert torch.equal(gen.get_state(), seeded_before)


def test_seeded_row_is_independent_of_the_batch():
    params = SamplingParams(temperature=1.0, seed=11)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))

    def tokens(others: int, draws_before: int) -> list[int]:
        sampler = Sampler(CPU, seed=draws_before)
        other = [SamplingParams(temperature=1.0)] * others
        meta = SamplingMetadata.build(other + [params], CPU, [None] * others + [make_generator(11, CPU)],
                                      drafts=[[]] * others + [[3, 4]])
        rows = torch.cat([torch.randn(others, 50), logits])
        return sampler(rows, meta).token_ids[-1]

    alone = tokens(0, 0)
    assert tokens(3, 1) == alone and tokens(5, 2) == alone


def test_seeded_row_without_drafts_draws_alike_beside_drafted_rows():
    """A seeded row without drafts takes the inverse CDF at its own uniform whether the step is
    plain or others in it have drafts (the drafted rows' uniforms join its own in one draw)."""
    params = SamplingParams(temperature=1.0, seed=5)
    row = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))

    def token(others: int, seed: int) -> int:
        other = [SamplingParams(temperature=1.0)] * others
        meta = SamplingMetadata.build([params] + other, CPU, [make_generator(seed, CPU)] + [None] * others,
                                      drafts=[[]] + [[3, 4]] * others)
        rows = torch.cat([row, torch.randn(3 * others, 50)])
        return Sampler(CPU, seed=others)(rows, meta).token_ids[0][0]

    for seed in range(20):
        assert token(2, seed) == token(0, seed) == token(4, seed), seed
    assert len({token(2, seed) for seed in range(20)}) > 3  # the seed decides, not the batch
