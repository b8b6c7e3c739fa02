"""The Triton rejection sampler equals the PyTorch reference exactly, on fresh random inputs
with the same injected randomness (TRITON_INTERPRET=1 on CPU, natively on a GPU)."""
from __future__ import annotations

import pytest
import torch

from specd.kernels import rejection_sampler as rs
from specd.kernels.rejection_sampler_ref import MODES, rejection_sample_ref

triton = pytest.importorskip("triton", reason="Triton is not installed (pip install -e '.[dev]')")
from specd.kernels.rejection_sampler_triton import rejection_sample_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_batch(g: torch.Generator, vocab: int, sparse_q: bool, all_greedy: bool = False, **mode) -> dict:
    """A ragged batch with mixed num_draft (0 included), greedy and random rows, drafts that
    are sometimes accepted (argmax or drawn from p) and sometimes not, zeros and ties in p."""
    B = int(torch.randint(1, 10, (), generator=g))
    num_draft = torch.randint(0, 6, (B,), generator=g)
    N = int(num_draft.sum())
    logits = torch.randn(N, vocab, generator=g) * 3
    logits[torch.rand(N, vocab, generator=g) < 0.2] = float("-inf")  # top-k/top-p zeros
    logits[:, 0] = logits[:, 1]  # exact ties
    logits[:, -1] = 0.0  # keeps every row finite
    probs = logits.softmax(-1)  # [N, V]: the target at each draft position
    kq = 4
    if sparse_q:
        # The drafter's top-K: ids where p is large, with noise so q and p disagree.
        score = probs * torch.rand(N, vocab, generator=g)
        score += 1e-3 * torch.rand(N, vocab, generator=g)
        q_ids = score.topk(kq, dim=-1).indices
        q_probs = torch.rand(N, kq, generator=g)
        q_ids[:, -1][torch.rand(N, generator=g) < 0.5] = -1  # padding
        q_probs = q_probs * (q_ids >= 0)
        q_probs = q_probs / q_probs.sum(-1, keepdim=True)
        drafts = q_ids.gather(1, torch.multinomial(q_probs, 1, generator=g))[:, 0] if N else q_ids[:, 0]
    else:
        q_ids = q_probs = None
        from_p = torch.multinomial(probs, 1, generator=g)[:, 0] if N else torch.zeros(0, dtype=torch.long)
        choice = torch.randint(0, 3, (N,), generator=g)
        drafts = torch.where(choice == 0, probs.argmax(-1),
                             torch.where(choice == 1, from_p, torch.randint(0, vocab, (N,), generator=g)))
    is_greedy = torch.ones(B, dtype=torch.bool) if all_greedy else torch.rand(B, generator=g) < 0.4
    meta = rs.SpecDecodeMetadata(
        draft_token_ids=drafts.long().to(DEVICE), num_draft=num_draft.to(DEVICE),
        cu_num_draft=rs.cu_num_draft_of(num_draft).to(DEVICE), num_draft_host=num_draft.tolist(),
        max_num_draft=int(num_draft.max()) + int(torch.randint(0, 2, (), generator=g)),
        is_greedy=is_greedy.to(DEVICE), all_greedy=all_greedy,
        draft_q_ids=None if q_ids is None else q_ids.to(DEVICE),
        draft_q_probs=None if q_probs is None else q_probs.to(DEVICE), **mode)
    args = dict(target_probs=probs, target_argmax=probs.argmax(-1), bonus_token_ids=torch.randint(0, vocab, (B,), generator=g),
                uniforms=torch.rand(N, generator=g), noise=torch.empty(B, vocab).exponential_(generator=g))
    return dict(meta=meta, **{k: v.to(DEVICE) for k, v in args.items()})


def assert_same(args: dict) -> tuple[torch.Tensor, torch.Tensor]:
    out_ref, n_ref = rejection_sample_ref(**args)
    out_tri, n_tri = rejection_sample_triton(**args)
    assert torch.equal(out_ref, out_tri), (out_ref, out_tri)
    assert torch.equal(n_ref, n_tri)
    return out_ref, n_ref


@pytest.mark.parametrize("vocab", [7, 64, 1500])  # 1500: more than one BLOCK_V of the vocab loop
@pytest.mark.parametrize("sparse_q", [False, True])
def test_kernel_equals_reference_strict(vocab, sparse_q):
    g = torch.Generator().manual_seed(vocab * 2 + sparse_q)
    accepted = rejected = 0
    for _ in range(20):
        args = random_batch(g, vocab, sparse_q)
        out, n_acc = assert_same(args)
        accepted += int(n_acc.sum())
        rejected += int((n_acc < args["meta"].num_draft).sum())
    assert accepted > 0 and rejected > 0  # the inputs exercised acceptance and recovery


@pytest.mark.parametrize("mode", ["typical", "synthetic"])
@pytest.mark.parametrize("sparse_q", [False, True])
def test_kernel_equals_reference_lossy_modes(mode, sparse_q):
    g = torch.Generator().manual_seed(100 + MODES[mode] * 2 + sparse_q)
    for _ in range(8):
        assert_same(random_batch(g, 48, sparse_q, mode=mode, posterior_threshold=0.09,
                                 posterior_alpha=0.3, synthetic_acceptance_rate=0.6))


@pytest.mark.parametrize("mode", ["strict", "synthetic"])
def test_kernel_equals_reference_all_greedy(mode):
    g = torch.Generator().manual_seed(7 + MODES[mode])
    for _ in range(6):
        args = random_batch(g, 33, sparse_q=False, all_greedy=True, mode=mode, synthetic_acceptance_rate=0.5)
        args.update(target_probs=None, noise=None)  # not needed: the random path never runs
        if mode == "strict":
            args.update(uniforms=None)
        assert_same(args)


def test_public_entry_dispatches_to_triton(monkeypatch):
    monkeypatch.setenv("SPECD_FORCE_TRITON", "1")
    assert rs.backend(DEVICE) == "triton"
    args = random_batch(torch.Generator().manual_seed(3), 40, sparse_q=True)
    out = rs.rejection_sample(**args)
    ref, n_ref = rejection_sample_ref(**args)
    assert torch.equal(out.output_token_ids, ref) and torch.equal(out.num_accepted, n_ref)
    assert out.lossy is False
