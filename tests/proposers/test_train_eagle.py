"""`specd train-drafter --method eagle`: what the trainer optimises is what the server runs.

The training head (transformers' decoder layer, batched with padding) and the serving `eagle`
proposer (specd's head layer over a per-sequence cache) must compute the same function: a
checkpoint the trainer writes, loaded by the proposer, drafts exactly the argmax chain of the
training head. A short training run lowers the loss.
"""
from __future__ import annotations

import pytest
import torch

from specd.proposers.base import ProposeRequest
from specd.proposers.hidden_state import HiddenStateProposer
from specd_train.drafter import eagle

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   initializer_range=0.2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    d = tmp_path_factory.mktemp("eagle-target")
    model.save_pretrained(d)
    return d, model


def _chain(head, tokens: list[int], feats: torch.Tensor, k: int, allowed: torch.Tensor | None = None) -> list[int]:
    """The training head's own k-step greedy chain after the pairs of `tokens` (EAGLE-1 feeds
    its predictions back as features), over the `allowed` ids only when given."""
    toks, rows = list(tokens[1:]), [r for r in feats[: len(tokens) - 1]]
    drafts = []
    with torch.no_grad():
        for _ in range(k):
            h = head(torch.tensor([toks]), torch.stack(rows)[None], torch.ones(1, len(toks), dtype=torch.long))[0, -1]
            logits = head.logits(h)
            d = int(logits.argmax()) if allowed is None else int(allowed[logits[allowed].argmax()])
            drafts.append(d)
            toks.append(d)
            rows.append(h)
    return drafts


def test_trained_checkpoint_drafts_what_the_training_head_computes(target, tmp_path):
    target_dir, model = target
    cfg = eagle.EagleConfig(epochs=3, batch_tokens=256, lr=3e-3, warmup=2)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 128, (int(n),), generator=gen) for n in torch.randint(20, 40, (24,), generator=gen)]
    feats = eagle.target_features(model, seqs, log=lambda *_: None)
    head = eagle.EagleTrainHead(model, cfg)
    report = eagle.train(head, seqs, feats, [5] * len(seqs), cfg, log=lambda *_: None)
    assert report["epochs"][-1]["loss"] < report["epochs"][0]["loss"]
    head = head.float()
    with torch.no_grad():  # make the head's choices decisive, so rounding cannot flip an argmax
        head.fc.weight.mul_(3)
    out = tmp_path / "head"
    eagle.save(head, model, out, "fp", cfg)
    # The checkpoint holds bf16 weights: compare against the head with exactly those weights.
    state = head.state_for_checkpoint()
    head.fc.load_state_dict({k[3:]: v.float() for k, v in state.items() if k.startswith("fc.")})
    head.layer.load_state_dict({k[9:]: v.float() for k, v in state.items() if k.startswith("layers.0.")},
                               strict=False)
    proposer = HiddenStateProposer("eagle", str(out), str(target_dir), num_speculative_tokens=4, dtype="float32",
                                   device="cpu")
    assert proposer.target_fingerprint == "fp" and proposer.feature_layers == (3,)
    for i, seq in enumerate(seqs[:6]):
        tokens = seq[:15].tolist()
        f = feats[i].float()
        got = proposer.propose([ProposeRequest(seq_id=i, new_tokens=tokens, num_tokens=len(tokens), k=4,
                                               full_history=True, features=f[: len(tokens) - 1],
                                               feature_layers=(3,))])[0].token_ids
        assert got == _chain(head, tokens, f, 4), f"sequence {i}"

    # With a draft vocabulary (d2t) the head scores only those rows and drafts only those ids.
    allowed = eagle.draft_vocabulary(seqs, [5] * len(seqs), 40, 128)
    assert allowed is not None and len(allowed) == 40
    eagle.save(head, model, tmp_path / "small", "fp", cfg, allowed)
    small = HiddenStateProposer("eagle", str(tmp_path / "small"), str(target_dir), num_speculative_tokens=4,
                                dtype="float32", device="cpu")
    differ = 0
    for i, seq in enumerate(seqs[:6]):
        tokens = seq[:15].tolist()
        f = feats[i].float()
        got = small.propose([ProposeRequest(seq_id=i, new_tokens=tokens, num_tokens=len(tokens), k=4,
                                            full_history=True, features=f[: len(tokens) - 1],
                                            feature_layers=(3,))])[0].token_ids
        assert got == _chain(head, tokens, f, 4, allowed) and set(got) <= set(allowed.tolist())
        differ += got != _chain(head, tokens, f, 4)
    assert differ  # the restriction mattered somewhere
