"""One token tree from several drafters (method "combined", issue 15 part 5).

Greedy: token-identical to plain decoding (float32) with draft_model + ngram merged, in mixed
batches with chunked prefill, and some accepted path runs through the second member's nodes
(so the merge is what made those tokens count). Sampled: a chi-square test at T=1 of the walk
over trees merged from two drafters with overlapping, sampled chains.
"""
from __future__ import annotations

import pytest
import torch

from chi2 import chi2_critical
from specd import SamplingParams
from specd.config import SpeculativeConfig
from specd.kernels import tree_rejection_sampler as trs
from specd.kernels.rejection_sampler import SpecDecodeMetadata
from specd.proposers.combined import merge_trees
from drafter_helpers import perturbed_copy, record_tree_paths

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def test_merge_is_a_trie_within_the_budget():
    # chain a: 5 6 7; tree b: 5 -> {6 -> 9, 8}; chain c: 4
    tokens, parents = merge_trees([([5, 6, 7], None), ([5, 6, 8, 9], [-1, 0, 0, 1]), ([4], None)], max_nodes=5)
    assert tokens == [5, 6, 7, 8, 9] and parents == [-1, 0, 1, 0, 1]  # 4 cut by the budget
    paths = set()
    for i in range(len(tokens)):
        path, j = [], i
        while j >= 0:
            path.append(tokens[j])
            j = parents[j]
        paths.add(tuple(reversed(path)))
    assert {(5, 6, 7), (5, 6, 9), (5, 8)} <= paths  # every member path survives the merge
    assert merge_trees([([1, 2], None), ([3], None)], max_nodes=8) == ([1, 2, 3], [-1, 0, -1])
    # A node whose parent was cut is cut too (parents must point at sent nodes).
    assert merge_trees([([1, 2], None), ([3, 4, 5], None)], max_nodes=3) == ([1, 2, 3], [-1, 0, -1])


def test_config_errors():
    for bad, words in [({"method": "combined"}, "at least two"),
                       ({"method": "combined", "members": [{"method": "suffix"}, {"method": "ngram"}],
                         "rejection_sample_method": "typical", "posterior_threshold": 0.1}, "strict"),
                       ({"method": "suffix", "members": [{"method": "ngram"}, {"method": "ngram"}]}, "only used"),
                       ({"method": "ngram", "tree": {"max_nodes": 8}}, "tree.branching")]:
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig.parse(bad)


@pytest.fixture(scope="module")
def target(model_dirs) -> str:
    return model_dirs["llama3"]


@pytest.fixture(scope="module")
def drafter(target, tmp_path_factory) -> str:
    return perturbed_copy(target, tmp_path_factory.mktemp("combined_drafter"), seed=1, scale=0.03)


def test_greedy_combined_identical_to_plain(target, drafter, get_llm, make_prompts):
    # Repeated segments: prompt lookup finds runs the model drafter does not guess.
    prompts = [p + p[:6] + p[2:8] + p[:6] if i % 3 else p
               for i, p in enumerate(make_prompts(9, seed=33, max_len=24))]
    plain = [o.token_ids for o in get_llm(target).generate(prompts, GREEDY)]
    spec = {"method": "combined", "num_speculative_tokens": 4, "adaptive": False,
            "members": [{"method": "draft_model", "model": drafter},
                        {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}]}
    llm = get_llm(target, fresh=True, max_num_batched_tokens=48, speculative_config=spec)
    seen = record_tree_paths(llm)  # (parents, accepted path) per verified tree
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == plain
    trees = [(p, path) for p, path in seen if p is not None]
    assert trees, "no merged tree was verified"
    # Node 0.. of a merged tree are the first member's chain (it merges first); an accepted path
    # that leaves that chain ran through nodes only the second member proposed.
    off_chain = [path for p, path in trees if path and path != list(range(len(path)))]
    assert off_chain, "no accepted path used the second member's nodes"
    blocks = llm.engine.block_manager
    assert blocks.num_free_blocks == blocks.num_total_blocks


# -- chi-square at T=1 on merged trees ----------------------------------------------------------

V = 6


def _chain(q_root: torch.Tensor, q_next: torch.Tensor, g) -> list[int]:
    x1 = int(torch.multinomial(q_root, 1, generator=g))
    return [x1, int(torch.multinomial(q_next[x1], 1, generator=g))]


def _merged_steps(n: int, seed: int):
    """n steps: two drafters each sample a chain of 2 from their own q (overlapping, so merges
    happen); the merged tree is walked as one-hot. -> emitted tokens, target, merges seen."""
    g = torch.Generator().manual_seed(seed)
    p_root = torch.rand(V, generator=g) + 0.05
    p_after = torch.rand(V, V, generator=g).pow(2) + 0.02
    p_root, p_after = p_root / p_root.sum(), p_after / p_after.sum(-1, keepdim=True)
    qa_root, qb_root = torch.tensor([0.05, 0.5, 0.05, 0.3, 0.05, 0.05]), torch.tensor([0.1, 0.4, 0.3, 0.0, 0.1, 0.1])
    qa_next, qb_next = p_after.roll(1, dims=1), p_after.roll(2, dims=0)
    drafts, parents, rows, merges = [], [], [], 0
    for _ in range(n):
        a, b = _chain(qa_root, qa_next, g), _chain(qb_root, qb_next, g)
        tokens, par = merge_trees([(a, None), (b, None)], max_nodes=8)
        merges += len(tokens) < 4
        drafts.append(tokens), parents.append(par)
        rows.append(torch.stack([p_root] + [p_after[t] for t in tokens]))
    meta = SpecDecodeMetadata.build(drafts, [False] * n, "cpu", None, parents)
    probs = torch.cat(rows)
    uniforms = torch.rand(meta.draft_token_ids.shape[0], generator=g)
    noise = torch.empty(n, V).exponential_(generator=g)
    tokens, _, _ = trs.tree_rejection_sample_ref(meta, probs, probs.argmax(-1), uniforms, noise)
    return tokens, p_root, p_after, merges


def _stat(counts: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    keep = expected > 5
    return float((((counts[keep] - expected[keep]) ** 2) / expected[keep]).sum()), chi2_critical(int(keep.sum()) - 1)


def test_merged_trees_keep_the_target_distribution():
    n = 6000
    tokens, p_root, p_after, merges = _merged_steps(n, seed=3)
    assert merges > n // 10, "the drafters rarely agreed: the merge was hardly tested"
    first = torch.bincount(torch.tensor([t[0] for t in tokens]), minlength=V).double()
    stat, critical = _stat(first, p_root.double() * n)
    assert stat < critical, f"first token: chi2 {stat:.1f} >= {critical:.1f}"
    pairs = torch.zeros(V, V, dtype=torch.float64)
    for t in tokens:
        if len(t) > 1:
            pairs[t[0], t[1]] += 1
    stat, critical = _stat(pairs.flatten(), (pairs.sum(-1, keepdim=True) * p_after.double()).flatten())
    assert stat < critical, f"second token given the first: chi2 {stat:.1f} >= {critical:.1f}"
