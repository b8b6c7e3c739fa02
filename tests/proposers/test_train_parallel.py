"""Training for parallel drafting: each training row sees what the served drafter sees.

The reference for a row is transformers' plain causal forward on what serving feeds: the
committed tokens up to the row's anchor followed by its masks. A training step must lower the
loss of the rows it trains on.
"""
from __future__ import annotations

import pytest
import torch

from specd_train.drafter import parallel
from specd_train.drafter.distill import SubsetHead

transformers = pytest.importorskip("transformers")
CFG = parallel.ParallelConfig(drafts=4, keep=(1.0, 0.7, 0.5, 0.3), pard_token=5, lr=3e-3, warmup=1)


@pytest.fixture
def head(model_dirs):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dirs["llama3"], dtype=torch.float32).eval()
    model.model.embed_tokens.weight.requires_grad_(False)
    return SubsetHead(model, torch.arange(model.config.vocab_size))


def test_every_row_equals_the_causal_forward_serving_runs(head, make_prompts):
    seqs = [torch.tensor(p) for p in make_prompts(3, seed=31, lengths=[12, 20, 16])]
    plens = [5, 9, 1]
    rows = [parallel.layout(s, p, CFG, torch.rand(len(s), generator=torch.Generator().manual_seed(i)))
            for i, (s, p) in enumerate(zip(seqs, plens))]
    ids, positions, mask, labels, weight = parallel.attention_mask(rows)
    with torch.no_grad():
        batched = head.drafter.lm_head(parallel._hidden(head, ids, positions, mask))
    checked = 0
    for b, (s, r) in enumerate(zip(seqs, rows)):
        assert (r.group > 0).any()
        for t in range(len(r.ids)):
            a, g = int(r.anchor[t]), int(r.group[t])
            served = torch.cat([s[: a + 1], torch.full((g,), CFG.pard_token)])
            with torch.no_grad():
                ref = head.drafter(served[None]).logits[0, -1]
            torch.testing.assert_close(batched[b, t], ref, atol=2e-4, rtol=1e-4)
            assert int(r.labels[t]) == int(s[a + g + 1])  # the token the row drafts
            checked += 1
    assert checked == int((labels >= 0).sum())  # padding carries no label


def test_a_few_steps_lower_the_loss(head, make_prompts):
    data = [(torch.tensor(p * 3), 4) for p in make_prompts(8, seed=32, max_len=12)]  # repeats: learnable
    batch = [parallel.layout(ids, plen, CFG, None) for ids, plen in data]
    with torch.no_grad():
        before = float(parallel._loss(head, batch))
    parallel.train(head, data, CFG, log=lambda *_: None)
    parallel.train(head, data, CFG, log=lambda *_: None)
    with torch.no_grad():
        after = float(parallel._loss(head, batch))
    assert after < 0.9 * before
