"""Greedy-acceptance bookkeeping on crafted match bits (no models needed)."""

import pytest
import torch

from specd_train.demo.evaluate import simulate


def _m(bits: str) -> torch.Tensor:
    return torch.tensor([[c == "1" for c in bits]])


def test_all_accepted_k4():
    a = simulate(_m("1" * 12), k=4, gen_len=8)
    # steps at pos 0 and 5 (4 accepted + bonus each): 2 steps, 8 drafted, 8 accepted
    assert (a.steps, a.drafted, sum(a.accepted)) == (2, 8, 8)
    assert a.per_position == [1.0] * 4 and a.alpha == 1.0 and a.tokens_per_step == 5.0


def test_mixed_run_lengths():
    # pos 0: run 2 (reject at 2) -> pos 3: run 0 -> pos 4: run 4 -> pos 9 >= gen_len
    a = simulate(_m("110" + "0" + "1111" + "0000"), k=4, gen_len=9)
    assert a.steps == 3 and a.drafted == 12
    assert a.attempted == [3, 2, 2, 1] and a.accepted == [2, 2, 1, 1]
    assert a.alpha == pytest.approx(6 / 12)
    assert a.per_position == pytest.approx([2 / 3, 1.0, 0.5, 1.0])


def test_needs_enough_columns():
    with pytest.raises(ValueError, match="match columns"):
        simulate(_m("1" * 5), k=4, gen_len=8)
