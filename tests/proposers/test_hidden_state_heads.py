"""Hidden-state heads on random-weight checkpoints written in each published layout.

For a tiny Llama target made with transformers, every layout (EAGLE-1 as yuhuili publishes it
and in the speculators format, EAGLE-3 both ways, Medusa .pt and .safetensors, the MLP
speculator untied and tied) is written with random weights, loaded through make_proposer, and
checked against a reference computed here from the raw tensors (transformers' own
LlamaDecoderLayer for EAGLE's layer), fed with features from the target's
`output_hidden_states` in base.py's convention:
(a) sampled drafts' q (top-k = the whole vocabulary, T = 1) equals the reference's softmax at
    every draft step (so the head's logits match, step after step);
(b) greedy drafts equal the reference's argmax chain, on a full history and after a delta;
(c) resync on wrong feature rows, release, k bounds, q sums to 1, seeded drafts reproduce.
"""
from __future__ import annotations

import json

import pytest
import torch

from specd.config import SpeculativeConfig
from specd.engine.sampler import draft_seed
from specd.proposers.base import ProposeRequest
from specd.proposers.factory import make_proposer

from head_layouts import LAYOUTS, write_layout

V, H, L = 96, 32, 8
PROMPT = [5, 17, 33, 8, 61, 42, 7, 90, 23, 11, 54, 3]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=L,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1,
                                   eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    d = tmp_path_factory.mktemp("target")
    model.save_pretrained(d)
    return str(d), model


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    """layout -> (method, head dir, reference)"""
    root = tmp_path_factory.mktemp("heads")
    return {name: write_layout(name, root / name, target[1]) for name in LAYOUTS}


def features(model, tokens: list[int], layers) -> torch.Tensor:
    """[len(tokens), F]: row p = the target's requested layers at position p, concatenated."""
    with torch.no_grad():
        hs = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i][0] for i in layers], dim=-1)


def full(seq_id, tokens, rows, k, **kw):
    return ProposeRequest(seq_id, list(tokens), len(tokens), k, full_history=True, features=rows, **kw)


def build(target_dir, method, head_dir, **kw):
    kw.setdefault("draft_dtype", "float32")  # the reference is float64 arithmetic; auto may pick bf16
    spec = SpeculativeConfig(method=method, model=str(head_dir), target_model=target_dir, **kw)
    return make_proposer(spec, target_vocab_size=V, seed=123)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sampled_q_equals_the_reference_distribution_at_every_step(layout, target, heads):
    target_dir, model = target
    method, head_dir, ref = heads[layout]
    p = build(target_dir, method, head_dir, num_speculative_tokens=3, draft_sample_method="sampled",
              draft_top_k=V)
    assert p.feature_layers == ref.feature_layers and p.hidden_size == H and p.target_layers == L
    assert p.target_fingerprint == ""  # published layouts carry none
    rows = features(model, PROMPT, p.feature_layers)
    (prop,) = p.propose([full(1, PROMPT, rows[:-1], 3, temperature=1.0, seed=7)])
    assert len(prop.token_ids) == 3 and len(prop.q_ids) == 3
    _, ref_logits = ref.chain(PROMPT, rows[:-1], 3, forced=prop.token_ids)
    for step, (ids, probs, logits) in enumerate(zip(prop.q_ids, prop.q_probs, ref_logits)):
        q = torch.zeros(V, dtype=torch.float64)
        q[torch.tensor(ids)] = torch.tensor(probs, dtype=torch.float64)
        want = logits.double().softmax(-1)
        assert torch.allclose(q, want, atol=2e-5), f"{layout} step {step}: max diff {(q - want).abs().max()}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_drafts_equal_the_reference_chain_on_full_history_and_deltas(layout, target, heads):
    target_dir, model = target
    method, head_dir, ref = heads[layout]
    p = build(target_dir, method, head_dir, num_speculative_tokens=3)
    rows = features(model, PROMPT, p.feature_layers)
    (prop,) = p.propose([full(1, PROMPT, rows[:-1], 3)])
    want, _ = ref.chain(PROMPT, rows[:-1], 3)
    assert prop.token_ids == want and prop.q_ids is None and not prop.resync
    # two tokens committed (the first draft and another token), with their rows
    history = PROMPT + [prop.token_ids[0], 44]
    rows = features(model, history, p.feature_layers)
    (prop,) = p.propose([ProposeRequest(1, history[-2:], len(history), 3, features=rows[-3:-1])])
    want, _ = ref.chain(history, rows[:-1], 3)
    assert prop.token_ids == want and not prop.resync
    # the incremental state drafts what a fresh full history does
    assert p.propose([full(2, history, rows[:-1], 3)])[0].token_ids == want
    # and the drafts depend on the features: other rows, other drafts (the check can fail)
    other = p.propose([full(3, history, rows[:-1].flip(0), 3)])[0].token_ids
    assert other != want or ref.chain(history, rows[:-1].flip(0), 3)[0] == want


@pytest.mark.parametrize("layout", ["eagle", "eagle3", "medusa_pt", "mlp"])
def test_resync_release_and_k_bounds(layout, target, heads):
    target_dir, model = target
    method, head_dir, _ = heads[layout]
    p = build(target_dir, method, head_dir, num_speculative_tokens=3)
    rows = features(model, PROMPT, p.feature_layers)
    # wrong row count, no features, wrong width: resync, never drafts
    for bad in (rows, rows[:-2], None, rows[:-1, :-1]):
        (prop,) = p.propose([full(1, PROMPT, bad, 3)])
        assert prop.resync and prop.token_ids == []
    # a delta for a sequence never seen, or whose row count is off
    assert p.propose([ProposeRequest(9, [4], 5, 3, features=rows[:1])])[0].resync
    assert not p.propose([full(1, PROMPT, rows[:-1], 3)])[0].resync
    more = features(model, PROMPT + [4], p.feature_layers)
    (prop,) = p.propose([ProposeRequest(1, [4], len(PROMPT) + 1, 3, features=more[-3:-1])])
    assert prop.resync  # two rows for one token; the state is dropped
    assert p.propose([ProposeRequest(1, [4], len(PROMPT) + 1, 3, features=more[-2:-1])])[0].resync
    # k bounds: never more than asked, nor than the configured / head maximum; k=0 drafts nothing
    assert len(p.propose([full(1, PROMPT, rows[:-1], 2)])[0].token_ids) == 2
    assert len(p.propose([full(1, PROMPT, rows[:-1], 10)])[0].token_ids) == 3
    assert p.propose([full(1, PROMPT, rows[:-1], 0)])[0].token_ids == []
    # a one-token history has no row to draft from: no drafts, no resync
    (prop,) = p.propose([full(4, PROMPT[:1], rows[:0], 3)])
    assert prop.token_ids == [] and not prop.resync
    # release drops the state: the next delta must resync
    p.release([1])
    assert p.propose([ProposeRequest(1, [4], len(PROMPT) + 1, 3, features=more[-2:-1])])[0].resync


@pytest.mark.parametrize("layout", ["eagle", "eagle3", "medusa_st", "mlp_tied"])
def test_sampled_drafts_are_seeded_and_q_sums_to_one(layout, target, heads):
    target_dir, model = target
    method, head_dir, _ = heads[layout]
    kw = dict(num_speculative_tokens=3, draft_sample_method="sampled", draft_top_k=8)
    p, p2 = build(target_dir, method, head_dir, **kw), build(target_dir, method, head_dir, **kw)
    rows = features(model, PROMPT, p.feature_layers)
    runs = {}
    for seed in range(6):
        a = p.propose([full(1, PROMPT, rows[:-1], 3, temperature=0.8, seed=seed)])[0]
        b = p2.propose([full(5, PROMPT, rows[:-1], 3, temperature=0.8, seed=seed)])[0]
        assert a.token_ids == b.token_ids and a.q_probs == b.q_probs  # seeded: reproducible anywhere
        for i, (ids, probs, tok) in enumerate(zip(a.q_ids, a.q_probs, a.token_ids)):
            assert len(ids) <= 8 and abs(sum(probs) - 1) < 1e-5 and tok in ids and min(probs) > 0
            # drawn from q with the generator of (seed, position), as draft_model's drafts are
            gen = torch.Generator().manual_seed(draft_seed(seed, len(PROMPT) + i))
            assert ids[int(torch.multinomial(torch.tensor(probs), 1, generator=gen))] == tok
        runs[seed] = tuple(a.token_ids)
    assert len(set(runs.values())) > 1  # the seed matters


def test_config_needs_model_and_target():
    with pytest.raises(ValueError, match="target_model"):
        SpeculativeConfig(method="eagle3", model="some/head")
    with pytest.raises(ValueError, match="'model'"):
        SpeculativeConfig(method="medusa", target_model="some/target")
    with pytest.raises(ValueError, match="target_model"):
        SpeculativeConfig(method="ngram", target_model="some/target")


def test_mismatched_checkpoint_is_refused_clearly(target, heads, tmp_path):
    import shutil

    target_dir, _ = target
    _, head_dir, _ = heads["medusa_st"]
    bad = tmp_path / "medusa"
    shutil.copytree(head_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["medusa_num_heads"] += 1
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="missing tensor"):
        build(target_dir, "medusa", bad)


@pytest.mark.parametrize("layout", ["eagle", "eagle3_speculators", "medusa_st", "mlp"])
def test_a_batch_drafts_what_each_sequence_drafts_alone(layout, target, heads):
    """Ragged batches (catch-up of different lengths, different k, a delta next to full
    histories) run as one forward per step; each sequence must still get its own drafts."""
    target_dir, model = target
    method, head_dir, ref = heads[layout]
    p = build(target_dir, method, head_dir, num_speculative_tokens=3)
    prompts = [PROMPT, PROMPT[3:9], [70, 71, 5, 9, 12, 13, 40, 41, 2, 8, 19, 27, 30, 31, 77][:13]]
    rows = [features(model, t, p.feature_layers) for t in prompts]
    ks = [3, 1, 2]
    alone = [ref.chain(t, r[:-1], k)[0] for t, r, k in zip(prompts, rows, ks)]
    p.propose([full(30, prompts[0][:-2], rows[0][:-3], 2)])  # known; its next message is a delta
    batch = [ProposeRequest(30, prompts[0][-2:], len(prompts[0]), 3, features=rows[0][-3:-1]),
             full(31, prompts[1], rows[1][:-1], 1), full(32, prompts[2], rows[2][:-1], 2)]
    assert [prop.token_ids for prop in p.propose(batch)] == alone


def test_a_recorded_target_fingerprint_is_reported(target, heads, tmp_path):
    import shutil

    target_dir, _ = target
    _, head_dir, _ = heads["mlp"]
    d = tmp_path / "mlp"
    shutil.copytree(head_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "specd_target_fingerprint": "ab12"}))
    assert build(target_dir, "mlp_speculator", d).target_fingerprint == "ab12"


def test_eagle_on_a_tied_target_uses_its_embeddings_as_lm_head(tmp_path):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   initializer_range=0.1, tie_word_embeddings=True)
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path / "target")
    method, head_dir, ref = write_layout("eagle", tmp_path / "eagle", model)
    p = build(str(tmp_path / "target"), method, head_dir, num_speculative_tokens=3)
    rows = features(model, PROMPT, p.feature_layers)
    assert p.feature_layers == (4,)
    assert p.propose([full(1, PROMPT, rows[:-1], 3)])[0].token_ids == ref.chain(PROMPT, rows[:-1], 3)[0]
