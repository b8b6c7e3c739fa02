"""The fused bf16 CPU path runs every decoder layer in one C++ call (torch.ops.specd_cpu.decoder_stack).

It must compute exactly what the layer-by-layer path computes: the same logits, bit for bit, at
every step of a run that mixes prefill chunks, plain decode rows, draft chains and token trees.
"""
from __future__ import annotations

import pytest
import torch

from specd import LLM, SamplingParams
from specd.engine.model.decoder import CausalLM
from specd.kernels import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.cpu_supported(), reason="the fused CPU ops need x86-64 Linux with AVX-512 or AVX2 + FMA")

SPECS = {
    "tree": {"method": "draft_model", "num_speculative_tokens": 3, "tree": {"branching": [2, 2, 1]},
             "adaptive": False},
    "chain": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 2,
              "adaptive": False},
}


def _run(target: str, spec: dict, prompts, stack: bool, monkeypatch) -> tuple[list[list[int]], list[torch.Tensor], int]:
    llm = LLM(target, speculative_config=dict(spec, model=target) if spec["method"] == "draft_model" else spec,
              dtype="bfloat16", max_num_batched_tokens=32, seed=0)
    model = llm.engine.runner.model
    assert cpu_ops.available() and model.stack is not None, "the stack should apply to this Llama in bf16"
    weights = model.stack[0]
    if not stack:
        model.stack = None  # forward() then takes the layer loop
    logits, forward = [], CausalLM.forward

    def recording(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if self is model:
            logits.append(out.clone())
        return out

    calls, stack_op = [], torch.ops.specd_cpu.decoder_stack

    def counting(*args):
        if args[1] is weights:  # the target's (a drafter has its own)
            calls.append(args[0].shape[0])
        return stack_op(*args)

    monkeypatch.setattr(CausalLM, "forward", recording)
    monkeypatch.setattr(torch.ops.specd_cpu, "decoder_stack", counting)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    monkeypatch.undo()
    return [o.token_ids for o in outs], logits, len(calls)


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_decoder_stack_equals_layer_by_layer(model_dirs, make_prompts, kind, monkeypatch):
    target = model_dirs["llama3"]
    prompts = [p + p[:4] + p[:4] for p in make_prompts(4, seed=5, lengths=[40, 9, 17, 3])]  # 40+8: chunked
    tokens, logits, stack_calls = _run(target, SPECS[kind], prompts, True, monkeypatch)
    ref_tokens, ref_logits, _ = _run(target, SPECS[kind], prompts, False, monkeypatch)
    assert stack_calls == len(logits), "a step of the target did not take the stack"
    assert tokens == ref_tokens
    assert len(logits) == len(ref_logits) > 5
    for i, (a, b) in enumerate(zip(logits, ref_logits)):
        assert torch.equal(a, b), f"step {i}: logits differ by up to {(a - b).abs().max().item()}"
