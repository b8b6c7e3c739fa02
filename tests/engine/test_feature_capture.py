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
from feature_recorder import FeatureRecorder, hf_features

from specd.config import EngineConfig, SpeculativeConfig
from specd.engine.llm_engine import LLMEngine
from specd.sampling import SamplingParams

transformers = pytest.importorskip("transformers")


def test_feature_rows_equal_transformers_hidden_states(model_dirs, hf_greedy, make_prompts):
    target = model_dirs["llama3"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    layers = (1, hf.config.num_hidden_layers)
    prompts = make_prompts(3, seed=7, lengths=[37, 20, 45])  # 37 and 45 prefill in chunks of 32
    new_tokens = 24
    references = [list(p) + hf_greedy(target, p, new_tokens, ignore_eos=True) for p in prompts]
    proposer = FeatureRecorder(layers, references, hf.config.vocab_size)
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
    assert all(outputs[i] == references[i][len(prompts[i]):] for i in range(len(prompts)))
    stats = list(engine.speculator.stats_by_drafter.values())
    assert sum(s.accepted_tokens for s in stats) > 0
    assert sum(s.draft_tokens - s.accepted_tokens for s in stats) > 0
    # The contract: one row per new token (full history: one fewer), a full history first.
    assert all(rows == wanted for _, _, rows, wanted, _ in proposer.requests)
    assert proposer.requests[0][0]
    for i, seen in proposer.rows.items():
        expected = hf_features(hf, references[i], layers)
        assert len(seen) >= len(prompts[i]) + new_tokens // 2  # prompt rows and decode rows
        for pos, row in seen.items():
            torch.testing.assert_close(row, expected[pos], rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"seq {i} position {pos}: {m}")
