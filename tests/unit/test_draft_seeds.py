"""Randomness of sampled drafts (issue 14): a seeded request's draft at a position draws from
(seed, position), so a resync never replays randomness that already drew verified drafts; the
unseeded drafter stream is never the verifier's."""
from __future__ import annotations

import pytest
import torch

from specd.models.demo_paths import demo_model_dir
from specd.proposers.base import ProposeRequest
from specd.proposers.draft_model import DraftModelProposer
from specd.engine.sampler import draft_seed

# At this temperature the drafter's top-16 distribution is nearly flat, so which of the 16 it
# picks (the rank) is decided by the random number alone, whatever the context.
FLAT = 1000.0
HISTORY = [5, 17, 99, 240, 31, 8, 77, 150]


@pytest.fixture(scope="module")
def proposer():
    return DraftModelProposer(str(demo_model_dir("drafter")), dtype="float32", device="cpu",
                              sample_method="sampled", top_k=16)


def _rank(proposer, seq_id: int, history: list[int], seed: int | None, k: int = 1, full: bool = True,
          new: list[int] | None = None) -> list[int]:
    (p,) = proposer.propose([ProposeRequest(seq_id=seq_id, new_tokens=history if full else new,
                                            num_tokens=len(history), k=k, full_history=full, temperature=FLAT,
                                            seed=seed)])
    assert not p.resync and len(p.token_ids) == k
    return [ids.index(t) for ids, t in zip(p.q_ids, p.token_ids)]


def test_a_resync_does_not_replay_the_randomness_of_first_contact(proposer):
    """First contact drafts positions L..L+3, the verifier accepts them, and the drafter loses the
    sequence (resync): the draft at L+4 must not reuse the random number that drew the one at L
    (a stream restarted from the seed would, and the rank would repeat every time)."""
    same = 0
    for seed in range(12):
        first = _rank(proposer, 100 + seed, HISTORY, seed, k=4)
        history = HISTORY + [1000 + j for j in range(4)]  # four committed tokens later
        after = _rank(proposer, 200 + seed, history, seed)  # full history again: a resync
        same += after[0] == first[0]
    assert same <= 4, f"the draft after a resync repeated first contact's randomness {same}/12 times"


def test_a_draft_depends_on_seed_and_position_not_on_what_came_before(proposer):
    seed = 7
    direct = _rank(proposer, 300, HISTORY + [42], seed)  # first contact at L+1
    _rank(proposer, 301, HISTORY, seed, k=3)  # first contact at L, then a delta to L+1
    via_delta = _rank(proposer, 301, HISTORY + [42], seed, full=False, new=[42])
    assert direct == via_delta
    # Different positions draw differently (the ranks of four drafts are not all the same).
    assert len(set(_rank(proposer, 302, HISTORY, seed, k=4))) > 1
    assert draft_seed(seed, 5) != draft_seed(seed, 6) and draft_seed(seed, 5) != seed


def test_unseeded_drafter_and_verifier_streams_are_independent(proposer):
    verifier_default = torch.Generator().manual_seed(0)  # the engine's default (--seed 0)
    other = DraftModelProposer(str(demo_model_dir("drafter")), dtype="float32", device="cpu",
                               sample_method="sampled")
    seeds = {proposer.generator.initial_seed(), other.generator.initial_seed(), verifier_default.initial_seed()}
    assert len(seeds) == 3  # random per drafter process, never the verifier's 0


def test_the_offline_engines_drafter_stream_is_derived_not_shared():
    from specd.config import EngineConfig, SpeculativeConfig
    from specd.engine.llm_engine import LLMEngine
    from specd.proposers.factory import in_process_proposer

    spec = SpeculativeConfig.parse({"method": "draft_model", "model": str(demo_model_dir("drafter")),
                                    "num_speculative_tokens": 2, "draft_sample_method": "sampled"})
    engine = LLMEngine(EngineConfig(model=str(demo_model_dir("target")), dtype="float32", device="cpu",
                                    num_kv_blocks=64), spec, proposer_factory=in_process_proposer)
    drafter_seed = engine.speculator.proposer.generator.initial_seed()
    assert drafter_seed != engine.sampler.default_generator.initial_seed()
    assert drafter_seed == draft_seed(engine.config.seed, -1)  # reproducible across runs
