"""Statistical test: emitted tokens follow the target distribution (docs/architecture.md,
"Speculation").

Each trial is one sequence; 250k trials go through ONE target-sampler + rejection_sample
call (the engine's split: the bonus from the sampler, the rest from the rejection sampler).
Every trial shares the same target rows p_1, p_2, p_3 (two draft positions and the bonus), at
temperature 1 and after top-p 0.9. Checked with a chi-square test at a 1e-6
false-positive rate: the first emitted token against p_1; the second, among trials that
accepted the first draft, against p_2; the bonus, among trials that accepted both, against
p_3. Drafts: a fixed token (deterministic proposer, q one-hot) or sampled per trial from a
sparse top-K q that disagrees with p. Deliberately broken samplers must fail the same check.
(Verifying sampled drafts as if q were one-hot is not a bug: it is lossless, only slower.)
"""
from __future__ import annotations


import pytest
import torch
from chi2 import chi2_critical

from specd.engine.sampler import Sampler, SamplingMetadata, apply_sampling_filters, make_generator
from specd.kernels import cpu_ops
from specd.kernels import rejection_sampler as rs
from specd.sampling import SamplingParams

TRIALS = 250_000
VOCAB = 12


def chi2_statistic(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """(statistic, critical value) of emitted tokens against probs; zero-probability tokens must
    never appear at all."""
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    expected = probs.double() * tokens.numel()
    support = expected > 0
    assert counts[~support].sum() == 0, f"tokens outside the target's support: {counts[~support]}"
    stat = float(((counts - expected)[support] ** 2 / expected[support]).sum())
    return stat, chi2_critical(int(support.sum()) - 1)


def target_rows(top_p: float) -> torch.Tensor:
    """p_1, p_2, p_3 [3, V] from fixed logits, through the engine's sampling filters."""
    base = torch.tensor([0.45, 0.15, 0.10, 0.08, 0.06, 0.05, 0.04, 0.03, 0.02, 0.01, 0.007, 0.003])
    logits = torch.stack([base.log(), base.log().roll(3), base.log().flip(0)])
    return apply_sampling_filters(logits, SamplingMetadata.build([SamplingParams(temperature=1.0, top_p=top_p)] * 3,
                                                                 "cpu"))


def sparse_q() -> tuple[torch.Tensor, torch.Tensor]:
    """A drafter's top-4 (ids, probs) per draft position, overlapping p only in part (-1 pads);
    id 11 at the second position has p_2 = 0 after top-p 0.9, so it is never accepted there."""
    ids = torch.tensor([[1, 0, 5, -1], [3, 4, 9, 11]])
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.4, 0.3, 0.2, 0.1]])
    return ids, probs


def make_trials(p: torch.Tensor, sparse: bool, seed: int = 0, race: bool = False) -> dict:
    g = make_generator(seed, torch.device("cpu"))
    num_draft = torch.full((TRIALS,), 2, dtype=torch.long)
    if sparse:
        q_ids1, q_probs1 = sparse_q()
        choice = torch.stack([torch.multinomial(q_probs1[i], TRIALS, replacement=True, generator=g)
                              for i in range(2)], 1)  # [T, 2]
        drafts = q_ids1[torch.arange(2), choice].reshape(-1)
        q_ids, q_probs = q_ids1.repeat(TRIALS, 1), q_probs1.repeat(TRIALS, 1)
    else:  # deterministic proposer: the draft is a fixed function of the context
        drafts = torch.tensor([0, 3]).repeat(TRIALS)  # the top tokens of p_1 and p_2
        q_ids = q_probs = None
    uniforms, noise = rs.draw_randomness([None] * TRIALS, num_draft.tolist(), VOCAB, "cpu", g, race=race)
    meta = rs.SpecDecodeMetadata(
        draft_token_ids=drafts, num_draft=num_draft, cu_num_draft=rs.cu_num_draft_of(num_draft),
        num_draft_host=num_draft.tolist(), max_num_draft=2, is_greedy=torch.zeros(TRIALS, dtype=torch.bool),
        all_greedy=False, draft_q_ids=q_ids, draft_q_probs=q_probs)
    return dict(meta=meta, target_probs=p.repeat(TRIALS, 1), draft_token_ids=drafts, draft_q_ids=q_ids,
                draft_q_probs=q_probs, uniforms=uniforms, noise=noise)


def sample(args: dict) -> rs.RejectionSampleOutput:
    """The engine's split on [p_1, p_2, p_3] per trial: bonus from p_3 by the target sampler."""
    meta, probs = args["meta"], args["target_probs"]
    bonus = Sampler.sample_target(probs[2::3].argmax(-1), probs[2::3], meta.is_greedy, args["noise"])
    draft_rows = probs.view(TRIALS, 3, VOCAB)[:, :2].reshape(-1, VOCAB)
    return rs.rejection_sample(meta, draft_rows, draft_rows.argmax(-1), bonus, args["uniforms"], args["noise"])


def check_positions(out: torch.Tensor, n_acc: torch.Tensor, p: torch.Tensor, min_samples: int) -> None:
    for position in range(3):
        reached = n_acc >= position
        tokens = out[reached, position]
        assert tokens.numel() >= min_samples[position], (position, tokens.numel())
        stat, critical = chi2_statistic(tokens, p[position])
        assert stat < critical, f"position {position}: chi2 {stat:.1f} >= {critical:.1f}"


@pytest.mark.parametrize("race", [False, True], ids=["inverse-cdf", "exp-race"])  # a CPU's draw, a GPU's
@pytest.mark.parametrize("top_p", [1.0, 0.9])
@pytest.mark.parametrize("sparse", [False, True], ids=["one-hot-q", "sparse-q"])
def test_emitted_tokens_follow_the_target(top_p, sparse, race):
    p = target_rows(top_p)
    out = sample(make_trials(p, sparse, seed=int(top_p * 10) + sparse, race=race))
    assert out.output_token_ids.shape == (TRIALS, 3)
    # >= 10^5 samples for the first and second emitted tokens; the bonus gets what reaches it.
    check_positions(out.output_token_ids, out.num_accepted, p, min_samples=[100_000, 100_000, 20_000])


@pytest.mark.skipif(not cpu_ops.cpu_supported(), reason="the fused CPU ops need x86-64 Linux with AVX-512 or AVX2 + FMA")
def test_the_cpu_walk_emits_the_target():
    """The engine's Sampler on a CPU verifies a sampled chain with one-hot drafts by the fused walk
    (verify_chains: a row read only while its chain is accepted, the target's weights by its own
    exp): the same check at T 0.7, with logits whose tempered softmax is p_1, p_2, p_3."""
    assert cpu_ops.available()
    p = target_rows(1.0)
    logits = (0.7 * p.log()).repeat(TRIALS, 1)
    meta = SamplingMetadata.build([SamplingParams(temperature=0.7)] * TRIALS, "cpu", drafts=[[0, 3]] * TRIALS)
    sampler = Sampler(torch.device("cpu"), seed=5)
    assert sampler._chains(logits, meta, torch.zeros(TRIALS, dtype=torch.float64)) == [True] * TRIALS
    out = sampler(logits, meta)
    width = max(len(t) for t in out.token_ids)
    tokens = torch.tensor([t + [-1] * (width - len(t)) for t in out.token_ids])
    check_positions(tokens, torch.tensor(out.num_accepted), p, min_samples=[100_000, 100_000, 20_000])


def broken_first_token(args: dict, bug: str) -> torch.Tensor:
    """The first emitted token of a sampler with one classic bug (position 0 only)."""
    p1, x, u = args["target_probs"][0::3], args["draft_token_ids"][0::2], args["uniforms"][0::2]
    q1 = torch.zeros_like(p1)
    if args["draft_q_ids"] is None:
        q1.scatter_(1, x[:, None], 1.0)
    else:
        ids, probs = args["draft_q_ids"][0::2], args["draft_q_probs"][0::2]
        q1.scatter_add_(1, ids.clamp_min(0), probs * (ids >= 0))
    p_x, q_x = p1.gather(1, x[:, None])[:, 0], q1.gather(1, x[:, None])[:, 0]
    if bug == "recovered from p":  # replacement from p instead of max(0, p - q)
        accept, residual = u * q_x < p_x, p1
    elif bug == "accept with p, not p/q":  # q forgotten in the accept test, kept in the residual
        accept, residual = u < p_x, (p1 - q1).clamp_min(0)
    else:  # "accept with q/p": ratio upside down
        accept, residual = u * p_x < q_x, (p1 - q1).clamp_min(0)
    return torch.where(accept, x, rs.draw_from(residual, args["noise"]))


@pytest.mark.parametrize("sparse, bug", [
    (False, "recovered from p"), (True, "recovered from p"),
    (True, "accept with p, not p/q"), (True, "accept with q/p"),
])
def test_broken_samplers_fail_the_check(sparse, bug):
    p = target_rows(0.9)
    args = make_trials(p, sparse, seed=11)
    stat, critical = chi2_statistic(broken_first_token(args, bug), p[0])
    assert stat > critical, (stat, critical)
    # ... while the real sampler passes on exactly these inputs.
    out = sample(args)
    assert chi2_statistic(out.output_token_ids[:, 0], p[0])[0] < critical


def test_chi2_critical_value():
    # Exact quantiles at alpha = 1e-6 (regularized incomplete gamma): Wilson–Hilferty is within
    # a few percent, and errs on the large (conservative) side.
    for df, exact in [(6, 38.258), (11, 48.866)]:
        assert exact <= chi2_critical(df) < exact * 1.04
