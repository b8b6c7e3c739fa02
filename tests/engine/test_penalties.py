"""Penalties, logit_bias and min_tokens inside verify blocks (specd/engine/penalties.py).

- The rows: apply_penalties against a row-by-row reference written from the definitions, on random
  logits, for a chain and a tree of drafts (each row counts the committed output and the drafts on
  its path), several sequences in one step with different settings.
- The distribution: 12,000 sampled answers with frequency + presence penalties and a logit_bias, drafted
  by a sampled draft model, against the exact penalised joint distribution of the second and third
  tokens (every 3-token answer enumerated through transformers; chi-square over the pairs). The same test with the penalty's drafts left out of the rows after
  a block's first (the mistake this guards against) must fail, and does.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from letters_model import tiny16_pair
from specd import SamplingParams
from specd.engine import penalties

transformers = pytest.importorskip("transformers")

EOS = 2


def reference_row(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """One row as plain decoding makes it, from the definitions (vLLM's order)."""
    x = logits.clone()
    if len(output) < p.min_tokens:
        for t in {EOS, *p.stop_token_ids}:
            x[t] = float("-inf")
    for t, b in p.logit_bias.items():
        x[t] += b
    for t in set(prompt) | set(output):
        if p.repetition_penalty != 1.0:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return x


def _entry(prompt, output, params, drafts=(), parents=None):
    seq = SimpleNamespace(prompt_token_ids=list(prompt), output_token_ids=list(output), params=params)
    d = SimpleNamespace(token_ids=list(drafts), parents=parents) if drafts else None
    return SimpleNamespace(seq=seq, num_logits=len(drafts) + 1, drafts=d, draft_token_ids=list(drafts))


def test_rows_count_the_drafts_on_their_path():
    V = 40
    torch.manual_seed(0)
    chain = SamplingParams(frequency_penalty=0.75, presence_penalty=0.5, repetition_penalty=1.25,
                           logit_bias={3: 2.0, 7: -100}, min_tokens=4, stop_token_ids=[9], max_tokens=20)
    tree = SamplingParams(frequency_penalty=-0.5, logit_bias={5: 1.5}, max_tokens=20)
    plain = SamplingParams(max_tokens=20)
    batch = [_entry([1, 4, 6], [5, 5, 8], chain, drafts=[5, 8, 5, 11]),
             _entry([1, 2], [3], plain, drafts=[3, 3]),  # not penalised: rows untouched
             _entry([6, 6], [7, 7, 5], tree, drafts=[5, 12, 5, 7], parents=[-1, -1, 0, 2])]
    logits = torch.randn(5 + 3 + 5, V) * 3
    out = penalties.apply_penalties(batch, logits, [EOS])
    expected = logits.clone()
    for i in range(5):  # chain: row i after drafts[:i]
        expected[i] = reference_row(logits[i], [1, 4, 6], [5, 5, 8] + [5, 8, 5, 11][:i], chain)
    paths = [[], [5], [12], [5, 5], [5, 5, 7]]  # tree rows: the root, then after the path to each node
    for i, path in enumerate(paths):
        expected[8 + i] = reference_row(logits[8 + i], [6, 6], [7, 7, 5] + path, tree)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    assert torch.equal(out[5:8], logits[5:8])
    unpenalised = logits[5:8].clone()
    assert penalties.apply_penalties([batch[1]], unpenalised, [EOS]) is unpenalised  # nothing to change: no copy


def _penalised_pairs(model, prompt: list[int], p: SamplingParams) -> torch.Tensor:
    """The exact joint distribution [V * V] of output tokens 1 and 2 under p's penalties, by enumeration
    of every 3-token output (token 0 summed out)."""
    V = model.config.vocab_size

    def probs(contexts: list[tuple]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(c) for c in contexts])).logits[:, -1].float()
        return torch.stack([reference_row(row, prompt, list(c), p) for row, c in zip(logits, contexts)]).softmax(-1)

    dist = {(): 1.0}
    for _ in range(3):
        contexts = list(dist)
        rows = probs(contexts).double()
        dist = {c + (t,): dist[c] * float(row[t]) for c, row in zip(contexts, rows) for t in range(V)}
    out = torch.zeros(V * V, dtype=torch.float64)
    for (_, t1, t2), w in dist.items():
        out[t1 * V + t2] += w
    return out


def _chi2(counts: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    keep = expected > 5
    stat = float((((counts[keep] - expected[keep]) ** 2) / expected[keep]).sum())
    rest_e, rest_c = float(expected[~keep].sum()), float(counts[~keep].sum())
    if rest_e > 0:
        stat += (rest_c - rest_e) ** 2 / rest_e
    df = int(keep.sum()) + (1 if rest_e > 0 else 0) - 1
    a = 2.0 / (9.0 * df)
    return stat, df * (1 - a + 4.753 * math.sqrt(a)) ** 3  # upper 1e-6 quantile (Wilson-Hilferty)


@pytest.fixture(scope="module")
def penalised_samples(tmp_path_factory):
    return tiny16_pair(tmp_path_factory, "tiny16pen", seed=3, drafter_scale=0.05)


@pytest.mark.parametrize("mutated", [False, True], ids=["as-built", "drafts-left-out"])
def test_sampled_output_follows_the_penalised_target(penalised_samples, get_llm, monkeypatch, mutated):
    target, drafter, hf_model = penalised_samples
    prompt = [1, 5, 7, 9, 5, 7]
    params = dict(max_tokens=3, temperature=1.0, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0,
                  logit_bias={11: 1.5, 4: -1.0})
    expected = _penalised_pairs(hf_model, prompt, SamplingParams(**params))
    if mutated:  # every row of a block counts the committed output only, as if drafts were not tokens yet
        monkeypatch.setattr(penalties, "path_to", lambda node, parents: [])
    cfg = {"method": "draft_model", "model": drafter, "num_speculative_tokens": 2, "adaptive": False,
           "draft_sample_method": "sampled", "draft_top_k": 4}
    n = 12_000
    llm = get_llm(target, fresh=True, max_num_seqs=1024, max_num_batched_tokens=4096, speculative_config=cfg)
    outs = llm.generate([prompt] * n, [SamplingParams(**params) for _ in range(n)])
    # drafts accepted: the rows after a block's first decide about one third token in ten
    assert sum(o.spec["accepted_tokens"] for o in outs) > n // 10
    # (token 1, token 2) pairs: what a row after a block's first decides depends on the draft before it
    pairs = torch.bincount(torch.tensor([o.token_ids[1] * 16 + o.token_ids[2] for o in outs]), minlength=256).double()
    stat, critical = _chi2(pairs, expected * n)
    if mutated:
        assert stat >= critical, f"leaving the drafts out went unnoticed: chi2 {stat:.1f} < {critical:.1f}"
    else:
        assert stat < critical, f"chi2 {stat:.1f} >= {critical:.1f}"
