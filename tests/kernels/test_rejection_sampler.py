"""Rejection sampler behaviour: crafted greedy cases, seeded determinism, lossy modes."""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from specd.engine.sampler import Sampler, SamplingMetadata, make_generator
from specd.kernels import rejection_sampler as rs
from specd.sampling import SamplingParams

HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.fixture(params=["reference", "triton"])
def backend(request, monkeypatch):
    if request.param == "triton":
        if not HAS_TRITON:
            pytest.skip("Triton is not installed (pip install -e '.[dev]')")
        if torch.cuda.is_available():  # these build CPU tensors; natively: test_rejection_sampler_kernel.py
            pytest.skip("the interpreted kernel on CPU tensors; on a GPU the kernel tests run it natively")
        monkeypatch.setenv("SPECD_FORCE_TRITON", "1")
    else:
        monkeypatch.delenv("SPECD_FORCE_TRITON", raising=False)
    assert rs.backend("cpu") == request.param
    return request.param


def one_hot_rows(argmaxes: list[int], vocab: int) -> torch.Tensor:
    """Target rows [len, V] whose argmax is given; mass spread so that no row is one-hot."""
    probs = torch.full((len(argmaxes), vocab), 0.5 / (vocab - 1))
    probs[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 0.5
    return probs


def verify(meta: rs.SpecDecodeMetadata, probs: torch.Tensor, uniforms, noise, argmax=None):
    """probs [N + B, V] in a verify forward's row order (each sequence's draft positions, then
    its last one): the target sampler draws the bonus tokens, the rejection sampler the rest."""
    draft_rows, bonus_rows = (torch.tensor(r, dtype=torch.long) for r in rs.target_rows(meta.num_draft_host))
    argmax = probs.argmax(-1) if argmax is None else argmax
    bonus = Sampler.sample_target(argmax[bonus_rows], None if meta.all_greedy else probs[bonus_rows],
                                  meta.is_greedy, noise)
    return rs.rejection_sample(meta, probs[draft_rows], argmax[draft_rows], bonus, uniforms, noise)


def run(drafts: list[list[int]], argmaxes: list[list[int]], vocab: int = 6, greedy=None, max_num_draft=None, **kw):
    greedy = [True] * len(drafts) if greedy is None else greedy
    probs = one_hot_rows([t for row in argmaxes for t in row], vocab)
    meta = rs.SpecDecodeMetadata.build(drafts, greedy, "cpu", **kw)
    if max_num_draft is not None:
        meta.max_num_draft = max_num_draft
    uniforms, noise = rs.draw_randomness([None] * len(drafts), meta.num_draft_host, vocab, "cpu",
                                         make_generator(0, torch.device("cpu")))
    return verify(meta, probs, uniforms, noise)


def test_greedy_crafted_cases(backend):
    out = run(
        drafts=[[1, 2, 3], [1, 5], [], [3, 3, 3]],
        argmaxes=[[1, 2, 3, 4], [1, 2, 0], [5], [0, 3, 3, 1]])
    assert out.output_token_ids.tolist() == [
        [1, 2, 3, 4],  # all accepted, then the bonus argmax
        [1, 2, -1, -1],  # accept the prefix, reject at 1: the replacement is the argmax there
        [5, -1, -1, -1],  # no drafts: only the bonus
        [0, -1, -1, -1],  # rejected at 0 (later drafts that match do not count)
    ]
    assert out.num_accepted.tolist() == [3, 1, 0, 0]
    assert rs.to_token_lists(out.output_token_ids) == [[1, 2, 3, 4], [1, 2], [5], [0]]
    assert out.lossy is False


def test_greedy_rows_in_a_mixed_batch_and_wider_output(backend):
    out = run(drafts=[[1, 2], [4]], argmaxes=[[1, 3, 0], [4, 2]], greedy=[True, False], max_num_draft=3)
    assert out.output_token_ids.shape == (2, 4)
    assert out.output_token_ids[0].tolist() == [1, 3, -1, -1]
    assert out.num_accepted[0] == 1


def test_all_greedy_needs_no_randomness(backend):
    meta = rs.SpecDecodeMetadata.build([[1, 0], [4]], [True, True], "cpu")
    probs = one_hot_rows([1, 2, 0, 4, 4], 6)
    out = verify(meta, probs, None, None)
    assert out.output_token_ids.tolist() == [[1, 2, -1], [4, 4, -1]]


def test_greedy_uses_the_given_argmax():
    # Probabilities tie; the raw logits' argmax (passed in) decides, as in non-speculative greedy.
    probs = torch.full((2, 4), 0.25)
    meta = rs.SpecDecodeMetadata.build([[3]], [True], "cpu")
    out = verify(meta, probs, None, None, argmax=torch.tensor([3, 2]))
    assert out.output_token_ids.tolist() == [[3, 2]]
    # The engine's sampler takes that argmax from the raw logits.
    logits = torch.tensor([[0.0, 0.0, 0.0, 1e-9], [0.0, 0.0, 1e-9, 0.0]])
    meta = SamplingMetadata.build([SamplingParams(temperature=0.0)], "cpu", drafts=[[3]])
    assert Sampler(torch.device("cpu"))(logits, meta).token_ids == [[3, 2]]


def seeded_batch_output(position: int, others: int, other_seed: int, sparse: bool,
                        seed: int = 1234) -> list[int]:
    """Sequence S (its own seed, 3 drafts) at `position` among `others` unrelated sequences,
    some seeded, some drawing from a shared generator."""
    vocab = 20
    g = torch.Generator().manual_seed(other_seed)
    s_probs = torch.softmax(torch.linspace(-2, 2, vocab).roll(5), -1).expand(4, vocab)
    s_drafts = [4, 3, 2]  # likely tokens: some steps accept, some reject
    num_draft, probs, drafts, gens = [], [], [], []
    for b in range(others + 1):
        if b == position:
            num_draft.append(3)
            probs.append(s_probs)
            drafts += s_drafts
            gens.append(make_generator(seed, torch.device("cpu")))
        else:
            k = int(torch.randint(0, 5, (), generator=g))
            num_draft.append(k)
            probs.append(torch.rand(k + 1, vocab, generator=g).softmax(-1))
            drafts += torch.randint(0, vocab, (k,), generator=g).tolist()
            gens.append(make_generator(other_seed + b, torch.device("cpu")) if b % 2 else None)
    nd = torch.tensor(num_draft)
    n = int(nd.sum())
    q_ids = q_probs = None
    if sparse:  # q over {x, x + 1}: 0.7 / 0.3
        q_ids = torch.stack([torch.tensor(drafts), (torch.tensor(drafts) + 1) % vocab], 1)
        q_probs = torch.tensor([[0.7, 0.3]]).expand(n, 2)
    uniforms, noise = rs.draw_randomness(gens, num_draft, vocab, "cpu",
                                         make_generator(other_seed, torch.device("cpu")))
    meta = rs.SpecDecodeMetadata(
        draft_token_ids=torch.tensor(drafts), num_draft=nd, cu_num_draft=rs.cu_num_draft_of(nd),
        num_draft_host=num_draft, max_num_draft=max(num_draft), is_greedy=torch.zeros(len(nd), dtype=torch.bool),
        all_greedy=False, draft_q_ids=q_ids, draft_q_probs=q_probs)
    out = verify(meta, torch.cat(probs), uniforms, noise)
    return rs.to_token_lists(out.output_token_ids)[position]


@pytest.mark.parametrize("sparse", [False, True])
def test_seeded_sequence_reproduces_whatever_the_batch(backend, sparse):
    alone = seeded_batch_output(0, 0, 1, sparse)
    assert seeded_batch_output(0, 0, 1, sparse) == alone
    for position, others, other_seed in [(0, 3, 2), (2, 5, 3), (6, 6, 4)]:
        assert seeded_batch_output(position, others, other_seed, sparse) == alone
    # The sequence's own seed is what decides: other seeds give other outputs.
    outputs = {tuple(seeded_batch_output(2, 3, 5, sparse, seed=s)) for s in range(20)}
    assert len(outputs) > 3


@pytest.mark.parametrize("race", [False, True])
def test_draw_randomness_is_per_generator(race):
    cpu = torch.device("cpu")
    u1, e1 = rs.draw_randomness([make_generator(5, cpu)], [3], 10, cpu, race=race)
    u2, e2 = rs.draw_randomness([None, make_generator(5, cpu)], [2, 3], 10, cpu, race=race)
    assert e2.shape == ((2, 10) if race else (2,))
    assert torch.equal(u1, u2[2:]) and torch.equal(e1[0], e2[1])
    u3, _ = rs.draw_randomness([make_generator(6, cpu)], [3], 10, cpu, race=race)
    assert not torch.equal(u1, u3)
    assert bool((e2 > 0).all()) and bool(((u2 >= 0) & (u2 < 1)).all())


@pytest.mark.parametrize("rate", [0.25, 0.8])
def test_synthetic_mode_accepts_at_the_set_rate_and_is_flagged(rate):
    trials, vocab = 100_000, 8
    probs = torch.full((2 * trials, vocab), 1.0 / vocab)
    is_greedy = torch.arange(trials) % 2 == 0  # applies to greedy rows too
    uniforms, noise = rs.draw_randomness([None] * trials, [1] * trials, vocab, "cpu",
                                         make_generator(int(rate * 100), torch.device("cpu")))
    meta = rs.SpecDecodeMetadata.build([[3]] * trials, is_greedy.tolist(), "cpu", mode="synthetic",
                                       synthetic_acceptance_rate=rate)
    out = verify(meta, probs, uniforms, noise)
    assert out.lossy is True
    observed = out.num_accepted.double().mean().item()
    assert abs(observed - rate) < 5 * math.sqrt(rate * (1 - rate) / trials), observed


def test_typical_mode_threshold_and_flag(backend):
    vocab = 8
    p = torch.tensor([0.6, 0.2, 0.08, 0.05, 0.03, 0.02, 0.01, 0.01])
    entropy = -sum(float(v) * math.log(float(v)) for v in p)
    alpha = 0.3
    cut = min(0.09, alpha * math.exp(-entropy))
    assert 0.08 < cut < 0.2  # token 1 (p = 0.2) passes, token 2 (p = 0.08) does not
    probs = p.expand(7, vocab).contiguous()
    drafts, greedy = [[1, 2], [2], [2]], [False, False, True]
    uniforms, noise = rs.draw_randomness([None] * 3, [2, 1, 1], vocab, "cpu")
    meta = rs.SpecDecodeMetadata.build(drafts, greedy, "cpu", mode="typical", posterior_threshold=0.09,
                                       posterior_alpha=alpha)
    out = verify(meta, probs, uniforms, noise)
    assert out.lossy is True
    assert out.num_accepted.tolist() == [1, 0, 0]  # greedy row 2: 2 is not the argmax
    assert out.output_token_ids[2].tolist() == [0, -1, -1]
    strict = verify(rs.SpecDecodeMetadata.build(drafts, greedy, "cpu"), probs, uniforms, noise)
    assert strict.lossy is False


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown rejection sample mode"):
        rs.SpecDecodeMetadata.build([[1]], [True], "cpu", mode="fast")
    with pytest.raises(ValueError, match="synthetic_acceptance_rate"):
        rs.SpecDecodeMetadata.build([[1]], [True], "cpu", mode="synthetic", synthetic_acceptance_rate=1.5)
    meta = rs.SpecDecodeMetadata.build([[1]], [True], "cpu")
    with pytest.raises(ValueError, match="go together"):
        rs.SpecDecodeMetadata(**{**meta.__dict__, "draft_q_ids": torch.tensor([[1]])})


def test_triton_is_optional(monkeypatch):
    import subprocess
    import sys

    code = "import sys, specd.kernels.rejection_sampler; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    monkeypatch.setattr(rs, "_triton_impl", lambda: None)  # as if Triton were not installed
    monkeypatch.setenv("SPECD_FORCE_TRITON", "1")
    assert rs.backend("cuda") == "reference" and rs.backend("cpu") == "reference"
