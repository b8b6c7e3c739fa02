"""`specd train-drafter --method medusa|mlp_speculator`: what the trainer optimises is what the
server runs. A short run on a tiny target lowers the loss; the checkpoint it writes, loaded by
the serving proposer (which shares the target's LM head and embeddings as the config says),
drafts exactly what the training module computes, within the draft vocabulary."""
from __future__ import annotations

import pytest
import torch

from specd.proposers.base import ProposeRequest
from specd.proposers.hidden_state import HiddenStateProposer
from specd_train.drafter import head_training as ht
from specd_train.drafter import medusa, mlp_speculator
from specd_train.drafter.head_card import lm_rows

transformers = pytest.importorskip("transformers")
VOCAB, L = 128, 3


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=L,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    d = tmp_path_factory.mktemp("head-target")
    model.save_pretrained(d)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, VOCAB, (int(n),), generator=gen) for n in torch.randint(20, 40, (24,), generator=gen)]
    final = ht.target_features(model, seqs, log=lambda *_: None)
    return d, model, seqs, final


def _round_to_bf16(module):  # the checkpoint stores bf16: compare against exactly those weights
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def _propose(proposer, i, tokens, rows):
    return proposer.propose([ProposeRequest(seq_id=i, new_tokens=tokens, num_tokens=len(tokens), k=4,
                                            full_history=True, features=rows[: len(tokens) - 1],
                                            feature_layers=(L,))])[0].token_ids


@pytest.mark.parametrize("method", ["medusa", "mlp_speculator"])
def test_trained_checkpoint_drafts_what_the_training_module_computes(target, tmp_path, method):
    target_dir, model, seqs, final = target
    pls = [5] * len(seqs)
    allowed = ht.draft_vocabulary(seqs, pls, 40, VOCAB)
    rows = lm_rows(target_dir, allowed)
    assert torch.equal(rows, model.lm_head.weight.detach()[allowed])
    if method == "medusa":
        cfg = medusa.MedusaConfig(epochs=4, batch_tokens=256, lr=3e-3, warmup=2)
        module = medusa.MedusaTrainHeads(rows, cfg)
    else:
        cfg = mlp_speculator.MLPSpeculatorConfig(epochs=4, batch_tokens=256, lr=3e-3, warmup=2)
        module = mlp_speculator.MLPSpeculatorTrain(model.model.embed_tokens.weight, rows, cfg)
    report = ht.train(module, lambda b, _g: module.loss(seqs, final, pls, b, cfg), [len(s) for s in seqs], cfg,
                      log=lambda *_: None)
    assert report["epochs"][-1]["loss"] < report["epochs"][0]["loss"]
    _round_to_bf16(module)
    out = tmp_path / method
    (medusa if method == "medusa" else mlp_speculator).save(module, model.config, out, "fp", cfg, allowed)
    proposer = HiddenStateProposer(method, str(out), str(target_dir), num_speculative_tokens=4, dtype="float32",
                                   device="cpu")
    assert proposer.target_fingerprint == "fp" and proposer.feature_layers == (L,) and proposer.max_k == 4
    drafted = set()
    for i, seq in enumerate(seqs[:8]):
        tokens, f = seq[:15].tolist(), final[i].float()
        last = f[len(tokens) - 2][None]  # the row that predicted the last token
        with torch.no_grad():
            if method == "medusa":
                want = [int(allowed[module.head_logits(last, a).argmax()]) for a in range(4)]
            else:
                want, state, tok = [], last, torch.tensor([tokens[-1]])
                for a in range(4):
                    state, logits = module.stage(state, tok, a)
                    tok = allowed[logits.argmax(-1)]
                    want.append(int(tok))
        got = _propose(proposer, i, tokens, f)
        assert got == want, f"sequence {i}"
        drafted |= set(got)
    assert drafted <= set(allowed.tolist()) and len(drafted) > 1


def test_ahead_targets_line_up_states_tokens_and_weights():
    seqs = [torch.arange(10, 20)]
    final = [torch.arange(10).float()[:, None].repeat(1, 2)]  # row j holds j
    inp, toks, goal, w = ht.ahead_targets(seqs, final, [4], [0], ahead=2, prompt_weight=0.25)
    assert inp[:, 0].tolist() == list(range(6))  # j + 2 + ahead < 10
    assert toks[0].tolist() == [11, 12, 13]  # x_{j+1}, x_{j+2}, x_{j+3} for j = 0
    assert goal[0, :, 0].tolist() == [1, 2, 3]  # f_{j+1+a} predicts x_{j+2+a}
    # position p predicts token p + 1: answer tokens (index >= 4) weigh 1
    assert w[0].tolist() == [0.25, 0.25, 1.0] and w[1].tolist() == [0.25, 1.0, 1.0]


def _eagle3_chain(head, tokens: list[int], rows: torch.Tensor, k: int, allowed: torch.Tensor) -> list[int]:
    """The training module's own k-draft chain, run as training-time test runs it: draft s + 1
    is step s's output at the last pair, each draft appended as the next pair's token."""
    c = len(tokens) - 1  # pairs 0 .. c - 1 come from the target
    toks, feats, drafts = list(tokens[1:]), rows[:c], []
    with torch.no_grad():
        for s in range(k):
            outs = head(torch.tensor([toks]), torch.cat([feats, torch.zeros(s, feats.shape[1])])[None], s + 1)
            drafts.append(int(allowed[head.logits(outs[s][0, c - 1 + s]).argmax()]))
            toks.append(drafts[-1])  # rows beyond the target's are never read by the chain
    return drafts


def test_trained_eagle3_checkpoint_drafts_what_training_time_test_computes(target, tmp_path):
    from specd_train.drafter import eagle3

    target_dir, model, seqs, final = target
    layers = ht.feature_layers(L)
    aux = layers[:3]
    feats = ht.columns(ht.target_features(model, seqs, log=lambda *_: None, layers=layers), layers, aux, 32)
    assert torch.equal(ht.columns(ht.target_features(model, seqs[:2], log=lambda *_: None, layers=layers),
                                  layers, (L,), 32)[1], final[1])  # layer L is the final normed state
    pls = [5] * len(seqs)
    allowed = ht.draft_vocabulary(seqs, pls, 40, VOCAB)
    cfg = eagle3.Eagle3Config(epochs=4, batch_tokens=256, lr=3e-3, warmup=2, ttt_steps=3)
    head = eagle3.Eagle3TrainHead(model, 3, lm_rows(target_dir, allowed))
    report = ht.train(head, lambda b, _g: head.loss(seqs, feats, final, pls, b, cfg), [len(s) for s in seqs], cfg,
                      log=lambda *_: None)
    assert report["epochs"][-1]["loss"] < report["epochs"][0]["loss"]
    _round_to_bf16(head)
    eagle3.save(head, model.config, tmp_path / "e3", "fp", cfg, aux, allowed)
    proposer = HiddenStateProposer("eagle3", str(tmp_path / "e3"), str(target_dir), num_speculative_tokens=4,
                                   dtype="float32", device="cpu")
    assert proposer.feature_layers == aux and proposer.target_fingerprint == "fp"
    drafted = set()
    for i, seq in enumerate(seqs[:6]):
        tokens, f = seq[:15].tolist(), feats[i].float()
        got = proposer.propose([ProposeRequest(seq_id=i, new_tokens=tokens, num_tokens=len(tokens), k=4,
                                               full_history=True, features=f[: len(tokens) - 1],
                                               feature_layers=aux)])[0].token_ids
        assert got == _eagle3_chain(head, tokens, f, 4, allowed), f"sequence {i}"
        drafted |= set(got)
    assert drafted <= set(allowed.tolist()) and len(drafted) > 1
