"""Token trees (issue 15 part 5): tree attention in the verify forward, tree-aware acceptance,
and the KV commit of the accepted path, lossless.

Greedy: token-identical to plain decoding (float32) for draft_model (static and dynamic) and ngram trees, in
batches that mix trees, chains, sequences without drafts and prefill chunks, with accepted
paths off the first branch. Sampled: a chi-square test at T=1 of the tree walk against the
target distribution, which fails when the sibling residual update is broken. KV: the cache
rows of committed positions equal those of a plain prefill of the same tokens.
"""
from __future__ import annotations

import math

import pytest
import torch

from specd import SamplingParams
from specd.engine.spec.speculator import Speculator
from specd.kernels import tree_rejection_sampler as trs
from specd.kernels.rejection_sampler import SpecDecodeMetadata, draw_from, rejection_sample
from specd.proposers.base import Proposal
from drafter_helpers import perturbed_copy, record_tree_paths

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def target(model_dirs) -> str:
    return model_dirs["llama3"]


@pytest.fixture(scope="module")
def drafter(target, tmp_path_factory) -> str:
    return perturbed_copy(target, tmp_path_factory.mktemp("tree_drafter"), seed=0, scale=0.02)


def _tree_configs(target: str, drafter: str) -> dict[str, dict]:
    return {
        "draft_model": {"method": "draft_model", "model": drafter, "num_speculative_tokens": 4,
                        "tree": {"branching": [3, 2, 1, 1]}, "adaptive": False},
        # EAGLE-2's dynamic trees: the shape follows the drafter's path probabilities.
        "draft_model_dynamic": {"method": "draft_model", "model": drafter, "num_speculative_tokens": 4,
                                "tree": {"branching": [4, 2, 2, 1], "max_nodes": 10, "dynamic": True},
                                "adaptive": False},
        "draft_model_self": {"method": "draft_model", "model": target, "num_speculative_tokens": 3,
                             "tree": {"branching": [2, 2, 1]}, "adaptive": False},
        # A single match is sent as a chain (parents None): batches mix chains and trees.
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 2,
                  "tree": {"branching": [4]}, "adaptive": False},
    }


def _prompts(make_prompts, n: int, seed: int) -> list[list[int]]:
    # Repeated segments with varied continuations so prompt lookup finds several matches.
    out = []
    for i, p in enumerate(make_prompts(n, seed=seed, max_len=24)):
        out.append(p + p[:3] + [p[-1]] + p[:3] + p[5:9] + p[:3] if i % 4 else p)
    return out


def _first_branch(parents: list[int]) -> list[int]:
    """The path that always takes the first child: what a walk of branch 0 only would accept."""
    path, cur = [], -1
    while True:
        child = next((i for i, p in enumerate(parents) if p == cur), None)
        if child is None:
            return path
        path.append(child)
        cur = child


@pytest.mark.parametrize("method", ["draft_model", "draft_model_dynamic", "draft_model_self", "ngram"])
def test_greedy_trees_identical_to_plain(method, target, drafter, get_llm, make_prompts):
    prompts = _prompts(make_prompts, 10, seed=21)
    plain = [o.token_ids for o in get_llm(target).generate(prompts, GREEDY)]
    # A small token budget: long prompts are prefilled in chunks while others already decode.
    llm = get_llm(target, fresh=True, max_num_batched_tokens=48, speculative_config=_tree_configs(target, drafter)[method])
    seen = record_tree_paths(llm)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == plain
    trees = [(p, path) for p, path in seen if p is not None]
    assert trees, "no tree was verified: the test would prove nothing"
    assert sum(o.spec["accepted_tokens"] for o in outs) > 0
    if method != "draft_model_self":  # self-drafting always accepts its own first branch
        off_branch = [path for p, path in trees if path and path != _first_branch(p)[: len(path)]]
        assert off_branch, "no accepted path left the first branch: branch-0-only acceptance would pass"
    if method == "ngram":
        assert any(p is None for p, _ in seen), "no chain in the batches"
    if method == "draft_model_dynamic":  # shapes chosen per step, within the budget
        shapes = {tuple(p) for p, _ in trees}
        assert len(shapes) > 1 and max(len(p) for p, _ in trees) <= 10, shapes
    blocks = llm.engine.block_manager
    assert blocks.num_free_blocks == blocks.num_total_blocks


def test_kv_of_accepted_path_sits_at_consecutive_positions(target, drafter, get_llm, make_prompts):
    prompt = _prompts(make_prompts, 2, seed=4)[1]
    llm = get_llm(target, fresh=True, speculative_config=_tree_configs(target, drafter)["draft_model"])
    seen = record_tree_paths(llm)
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), seq_id=7)
    seq = engine.sequences[7]
    moved = False
    while not moved and engine.has_unfinished():
        engine.step()
        moved = any(path and path != _first_branch(p)[: len(path)] for p, path in seen if p is not None)
    assert moved, "no step accepted a path off the first branch"
    n, tokens, table = seq.num_computed_tokens, seq.token_ids[: seq.num_computed_tokens], list(seq.block_table)
    plain = get_llm(target, fresh=True).engine
    plain.add_request(tokens, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), seq_id=8)
    ref = plain.sequences[8]
    plain.step()  # prefills the committed tokens in one chunk (and samples a first token)
    bs = engine.block_manager.block_size

    def rows(e, tab, layer):
        slots = torch.tensor([tab[i // bs] * bs + i % bs for i in range(n)])
        k, v = e.runner.kv_caches[layer]
        return k.view(-1, *k.shape[2:])[slots], v.view(-1, *v.shape[2:])[slots]

    for layer in range(len(engine.runner.kv_caches)):
        (k1, v1), (k2, v2) = rows(engine, table, layer), rows(plain, ref.block_table, layer)
        torch.testing.assert_close(k1, k2, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-5)


# -- the tree walk on crafted inputs ---------------------------------------------------------

def _meta(drafts, parents, greedy, q=None):
    return SpecDecodeMetadata.build(drafts, greedy, "cpu", q, parents)


def test_greedy_walk_follows_the_matching_sibling():
    V = 8
    # root -> children 3, 5 (node 0, 1); node 1 -> children 6, 2 (nodes 2, 3); node 3 -> child 4 (node 4)
    drafts, parents = [[3, 5, 6, 2, 4]], [[-1, -1, 1, 1, 3]]
    argmax = torch.tensor([5, 0, 2, 0, 4, 7])  # rows: root, node 0 .. node 4
    tokens, n_acc, paths = trs.tree_rejection_sample_ref(_meta(drafts, parents, [True]), None, argmax, None, None)
    assert paths == [[1, 3, 4]] and tokens == [[5, 2, 4, 7]] and n_acc == [3]
    argmax[0] = 1  # no child matches the root's argmax: only the replacement
    tokens, n_acc, paths = trs.tree_rejection_sample_ref(_meta(drafts, parents, [True]), None, argmax, None, None)
    assert tokens == [[1]] and paths == [[]]
    assert V > 7


@pytest.mark.parametrize("race", [False, True], ids=["inverse-cdf", "exp-race"])  # a CPU's draw, a GPU's
def test_chain_as_tree_takes_the_chain_samplers_decisions(race):
    g = torch.Generator().manual_seed(0)
    B, V = 6, 12
    ks = [3, 0, 4, 2, 1, 3]
    drafts = [torch.randint(0, V, (k,), generator=g).tolist() for k in ks]
    greedy = [False, True, False, False, True, False]
    q = []
    for d in drafts:
        q.append([([t, (t + 1) % V], [0.7, 0.3]) for t in d])
    q[3] = None  # one-hot
    R = sum(ks) + B
    probs = torch.rand(R, V, generator=g).pow(3)
    probs /= probs.sum(-1, keepdim=True)
    argmax = probs.argmax(-1)
    uniforms = torch.rand(sum(ks), generator=g)
    noise = torch.empty(B, V).exponential_(generator=g) if race else torch.rand(B, dtype=torch.float64, generator=g)
    chain = SpecDecodeMetadata.build(drafts, greedy, "cpu", q)
    draft_rows = [r for b, k in enumerate(ks) for r in range(sum(ks[:b]) + b, sum(ks[:b]) + b + k)]
    bonus_rows = [sum(ks[:b + 1]) + b for b in range(B)]
    bonus = torch.where(torch.tensor(greedy), argmax[bonus_rows], draw_from(probs[bonus_rows], noise))
    ref = rejection_sample(chain, probs[draft_rows], argmax[draft_rows], bonus, uniforms, noise)
    tree = _meta(drafts, [trs.chain_parents(k) for k in ks], greedy, q)
    tokens, n_acc, _ = trs.tree_rejection_sample_ref(tree, probs, argmax, uniforms, noise)
    assert tokens == [[t for t in row if t >= 0] for row in ref.output_token_ids.tolist()]
    assert n_acc == ref.num_accepted.tolist()


# -- chi-square at T=1 ------------------------------------------------------------------------

V_SMALL = 6


def _target(g) -> tuple[torch.Tensor, torch.Tensor]:
    """p_root [V] and p_after[y] [V, V]: the target's distribution after token y."""
    p_root = torch.rand(V_SMALL, generator=g) + 0.05
    p_after = torch.rand(V_SMALL, V_SMALL, generator=g).pow(2) + 0.02
    return p_root / p_root.sum(), p_after / p_after.sum(-1, keepdim=True)


def _draw_children(q: torch.Tensor, width: int, g) -> list[tuple[int, list[int], list[float]]]:
    """width draws without replacement from q, each with its conditional q (as draft_model sends)."""
    out, q = [], q.clone()
    for _ in range(width):
        cond = q / q.sum()
        x = int(torch.multinomial(cond, 1, generator=g))
        ids = [i for i in range(V_SMALL) if cond[i] > 0]
        out.append((x, ids, [float(cond[i]) for i in ids]))
        q[x] = 0.0
    return out


def _sample_trees(n: int, one_hot: bool, seed: int, race: bool = False):
    """n independent steps: a tree of depth 2 (3 children of the root, 2 under each), target rows,
    randomness; returns (first emitted token, second or -1) per step, and the target."""
    g = torch.Generator().manual_seed(seed)
    p_root, p_after = _target(g)
    q_root = torch.tensor([0.05, 0.4, 0.05, 0.3, 0.1, 0.1])  # far from p: many rejections
    drafts, parents, qs, rows = [], [], [], []
    for _ in range(n):
        d, par, qq, rr = [], [], [], [p_root]
        level1 = _draw_children(q_root, 3, g)
        for x, ids, probs in level1:
            d.append(x), par.append(-1), qq.append((ids, probs)), rr.append(p_after[x])
        for parent, (x1, _, _) in enumerate(level1):
            q2 = p_after[(x1 + 1) % V_SMALL]  # the drafter's guess of the next distribution
            for x, ids, probs in _draw_children(q2, 2, g):
                d.append(x), par.append(parent), qq.append((ids, probs)), rr.append(p_after[x])
        drafts.append(d), parents.append(par), rows.append(torch.stack(rr))
        qs.append(None if one_hot else qq)
    meta = _meta(drafts, parents, [False] * n, None if one_hot else qs)
    probs = torch.cat(rows)
    uniforms = torch.rand(meta.draft_token_ids.shape[0], generator=g)
    noise = (torch.empty(n, V_SMALL).exponential_(generator=g) if race
             else torch.rand(n, dtype=torch.float64, generator=g))
    tokens, _, _ = trs.tree_rejection_sample_ref(meta, probs, probs.argmax(-1), uniforms, noise)
    return tokens, p_root, p_after


def _chi2(counts: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    keep = expected > 5
    stat = float((((counts[keep] - expected[keep]) ** 2) / expected[keep]).sum())
    df = int(keep.sum()) - 1
    a = 2.0 / (9.0 * df)
    return stat, df * (1 - a + 4.753 * math.sqrt(a)) ** 3  # upper 1e-6 quantile (Wilson–Hilferty)


def _tree_chi2(one_hot: bool, n: int = 6000, race: bool = False) -> list[tuple[float, float]]:
    tokens, p_root, p_after = _sample_trees(n, one_hot, seed=1 if one_hot else 2, race=race)
    first = torch.tensor([t[0] for t in tokens])
    out = [_chi2(torch.bincount(first, minlength=V_SMALL).double(), p_root.double() * n)]
    # Given the first token y was an accepted node, the second follows p_after[y]: joint over (y, z).
    pairs = [(t[0], t[1]) for t in tokens if len(t) > 1]
    counts = torch.zeros(V_SMALL, V_SMALL, dtype=torch.float64)
    for y, z in pairs:
        counts[y, z] += 1
    per_y = counts.sum(-1, keepdim=True)
    out.append(_chi2(counts.flatten(), (per_y * p_after.double()).flatten()))
    return out


@pytest.mark.parametrize("race", [False, True], ids=["inverse-cdf", "exp-race"])
@pytest.mark.parametrize("one_hot", [False, True])
def test_sampled_tree_chi_square(one_hot, race):
    for stat, critical in _tree_chi2(one_hot, race=race):
        assert stat < critical, f"chi2 {stat:.1f} >= {critical:.1f}"


def test_chi_square_catches_a_broken_residual(monkeypatch):
    # Without the residual update, a later sibling is tested against p itself: tokens the
    # earlier siblings already covered are over-produced.
    monkeypatch.setattr(trs, "_residual", lambda p, q: p)
    results = _tree_chi2(one_hot=False)
    assert results[0][0] > results[0][1], f"chi2 {results[0][0]:.1f} stayed below {results[0][1]:.1f}"


# -- validation --------------------------------------------------------------------------------

def test_speculator_cuts_invalid_trees():
    from specd.config import SpeculativeConfig

    spec = Speculator(SpeculativeConfig(method="ngram", tree={"branching": [2], "max_nodes": 5}), None, 100, 1000)
    ok = spec.validator.validated(Proposal(0, [5, 6, 7, 8], parents=[-1, -1, 0, 2]), k=3)
    assert ok[0] == [5, 6, 7, 8] and ok[2] == [-1, -1, 0, 2]
    assert spec.validator.validated(Proposal(0, [5, 6, 7], parents=[-1, 2, 0]), k=3)[0] == [5]  # forward parent
    assert spec.validator.validated(Proposal(0, [5, 6, 7], parents=[-1, 0, 1]), k=2)[0] == [5, 6]  # deeper than k
    assert spec.validator.validated(Proposal(0, [5, 600, 7], parents=[-1, 0, 1]), k=3)[0] == [5]  # outside the vocab
    assert len(spec.validator.validated(Proposal(0, list(range(9)), parents=[-1] * 9), k=3)[0]) == 5  # max_nodes
    chains_only = Speculator(SpeculativeConfig(method="ngram"), None, 100, 1000)
    assert chains_only.validator.validated(Proposal(0, [5, 6], parents=[-1, 0]), k=3)[0] == []
