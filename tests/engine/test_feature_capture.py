"""The engine captures the target's hidden states for hidden-state drafters in its own forward.

A proposer that asks for features (here: layers 1 and L of a tiny Llama, i.e. the residual
stream entering layer 1 and the final normed state) gets, with every request, one row per
new token: the state that predicted it. Those rows must equal transformers'
`output_hidden_states` on the final token sequence, through chunked prefill, accepted drafts
and rejected drafts (whose rows must not leak), and for several sequences in one batch.
"""
from __future__ import annotations

import pytest
import torch

from specd.config import EngineConfig, SpeculativeConfig
from specd.engine.llm_engine import LLMEngine
from specd.proposers.base import Proposal, feature_rows
from specd.sampling import SamplingParams

transformers = pytest.importorskip("transformers")


class FeatureCheckingProposer:
    """Drafts the reference continuation for two tokens, then a wrong one (so steps see both
    accepted and rejected drafts), and keeps every feature row it is sent, by position."""

    def __init__(self, layers: tuple[int, ...], reference: dict[int, list[int]], vocab: int):
        self.feature_layers = layers
        self.reference, self.vocab = reference, vocab  # seq_id -> full greedy token sequence
        self.rows: dict[int, dict[int, torch.Tensor]] = {}
        self.known: dict[int, int] = {}
        self.requests = []

    def propose(self, batch):
        out = []
        for req in batch:
            self.requests.append((req.full_history, len(req.new_tokens), req.features.shape[0], feature_rows(req)))
            first = req.num_tokens - len(req.new_tokens) - 1
            if req.full_history:
                first, new = 0, req.new_tokens[1:]
            else:
                new = req.new_tokens
            rows = self.rows.setdefault(req.seq_id, {})
            for i in range(len(new)):
                rows[first + i] = req.features[i].clone()
            ref, n = self.reference[req.seq_id], req.num_tokens
            drafts = ref[n: n + min(2, req.k)]
            if len(drafts) < req.k and n + len(drafts) < len(ref):
                drafts.append((ref[n + len(drafts)] + 1) % self.vocab)  # wrong: rejected
            out.append(Proposal(seq_id=req.seq_id, token_ids=drafts))
        return out

    def release(self, seq_ids):
        pass


def test_feature_rows_equal_transformers_hidden_states(model_dirs, hf_greedy, make_prompts):
    target = model_dirs["llama3"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    L = hf.config.num_hidden_layers
    layers = (1, L)
    prompts = make_prompts(3, seed=7, lengths=[37, 20, 45])  # 37 and 45 prefill in chunks of 32
    new_tokens = 24
    reference = {i: list(p) + hf_greedy(target, p, new_tokens, ignore_eos=True) for i, p in enumerate(prompts)}
    proposer = FeatureCheckingProposer(layers, reference, hf.config.vocab_size)
    engine = LLMEngine(EngineConfig(model=target, dtype="float32", max_num_batched_tokens=32, seed=0),
                       SpeculativeConfig(num_speculative_tokens=3, adaptive=False), proposer=proposer)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, seq_id=i)
    outputs = {}
    while engine.has_unfinished():
        for seq in engine.step():
            outputs[seq.seq_id] = seq.output_token_ids
    # Speculation with these drafts keeps greedy output exact, and drafts were both kept and thrown away.
    assert all(outputs[i] == reference[i][len(prompts[i]):] for i in range(len(prompts)))
    counters = [s for s in engine.speculator.stats_by_drafter.values()]
    assert sum(c.accepted_tokens for c in counters) > 0
    assert sum(c.draft_tokens - c.accepted_tokens for c in counters) > 0
    # The contract: one row per new token (full history: one fewer), a full history first.
    assert all(got == want for _, _, got, want in proposer.requests)
    assert proposer.requests[0][0]
    for i, seq_rows in proposer.rows.items():
        ids = torch.tensor([reference[i]])
        with torch.no_grad():
            hs = hf(ids, output_hidden_states=True).hidden_states
        expected = torch.cat([hs[j][0] for j in layers], dim=-1)  # [len, 2H]
        assert len(seq_rows) >= len(prompts[i]) + new_tokens // 2  # prompt rows and decode rows
        for pos, row in seq_rows.items():
            torch.testing.assert_close(row, expected[pos], rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"seq {i} position {pos}: {m}")
