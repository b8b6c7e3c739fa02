"""The drafter's training data: windows ending in the target's own greedy text, mixed into
corpus batches. Checked against a teacher-forced forward pass of the same (random) model."""

from __future__ import annotations

import pytest
import torch

from specd_train.demo.models import TINY_TARGET_SIZE, build_model, llama_config
from specd_train.demo.train import Schedule, batches, greedy_pool, mixed_batches

SCHED = Schedule(steps=3, batch=6, context=24, lr=1e-3, warmup=1)
VOCAB = 97


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(llama_config(TINY_TARGET_SIZE, VOCAB, bos_id=1, eos_id=2, pad_id=0)).eval()


@pytest.fixture(scope="module")
def stream():
    return torch.randint(3, VOCAB, (500,), generator=torch.Generator().manual_seed(1))


def test_pool_windows_end_in_the_models_greedy_continuation(model, stream):
    prompt_len = 10
    pool = greedy_pool(model, stream, SCHED, rows=5, prompt_len=prompt_len, seed=3, device="cpu", chunk=2)
    assert pool.shape == (5, SCHED.context + 1)
    # The prefix is a contiguous slice of the corpus stream.
    slices = stream.unfold(0, prompt_len, 1)  # [N - prompt_len + 1, prompt_len]
    for row in pool:
        assert (slices == row[:prompt_len]).all(1).any(), "pool prefix is not a corpus slice"
    # Every later token is the argmax of a teacher-forced pass over the window itself.
    with torch.no_grad():
        pred = model(input_ids=pool[:, :-1]).logits.argmax(-1)  # [5, context]
    assert torch.equal(pred[:, prompt_len - 1 :], pool[:, prompt_len:])
    # Seeded: the same call gives the same windows, another seed others.
    again = greedy_pool(model, stream, SCHED, rows=5, prompt_len=prompt_len, seed=3, device="cpu", chunk=5)
    assert torch.equal(pool, again)
    other = greedy_pool(model, stream, SCHED, rows=5, prompt_len=prompt_len, seed=4, device="cpu")
    assert not torch.equal(pool, other)


def test_greedy_prompt_must_fit_the_window(model, stream):
    with pytest.raises(ValueError, match="does not fit"):
        greedy_pool(model, stream, SCHED, rows=2, prompt_len=SCHED.context + 1, seed=0, device="cpu")


def test_mixed_batches_replace_the_tail_rows_with_pool_windows(stream):
    pool = torch.arange(4 * (SCHED.context + 1)).view(4, -1) + 10_000  # rows no corpus window can equal
    plain = list(batches(stream, SCHED, seed=5, device="cpu"))
    mixed = list(mixed_batches(stream, pool, 0.5, SCHED, seed=5, device="cpu"))
    assert len(mixed) == SCHED.steps
    pool_rows = {tuple(r.tolist()) for r in pool}
    for p, m in zip(plain, mixed):
        assert m.shape == p.shape
        assert torch.equal(m[:3], p[:3])  # corpus rows keep their seeded order
        assert all(tuple(r.tolist()) in pool_rows for r in m[3:])
    # No pool (or share 0): exactly the corpus batches.
    for p, m in zip(plain, mixed_batches(stream, None, 0.5, SCHED, seed=5, device="cpu")):
        assert torch.equal(p, m)
