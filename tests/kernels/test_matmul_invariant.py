"""The batch-invariant Triton matmul: equals torch's matmul up to rounding, and gives each row
the same bits whatever the number of rows computed with it (TRITON_INTERPRET=1 on CPU)."""
from __future__ import annotations

import pytest
import torch

kernel = pytest.importorskip("specd.kernels.matmul_invariant_triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # natively on a GPU, interpreted elsewhere


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_torch(dtype, tol, bias):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(19, 72, generator=g).to(DEVICE, dtype), (torch.randn(100, 72, generator=g) * 0.1).to(DEVICE, dtype)
    b = torch.randn(100, generator=g).to(DEVICE, dtype) if bias else None
    torch.testing.assert_close(kernel.matmul_invariant(x, w, b).float(), torch.nn.functional.linear(x, w, b).float(),
                               atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_do_not_depend_on_the_row_count(dtype):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(37, 200, generator=g).to(DEVICE, dtype), torch.randn(70, 200, generator=g).to(DEVICE, dtype)
    full = kernel.matmul_invariant(x, w)
    for m in (1, 2, 5, 16, 17, 36):
        assert torch.equal(kernel.matmul_invariant(x[:m], w), full[:m]), m
    assert torch.equal(kernel.matmul_invariant(x[20:21], w), full[20:21])  # a row alone, from mid-batch


def test_engine_uses_it_in_batch_invariant_mode_where_forced(llama_dir, monkeypatch):
    """SPECD_FORCE_TRITON=1 stands in for a GPU: the engine's linears become the Triton kernel and
    decode the same greedy tokens as the default path. (Whether the mode stays on is the self-test's
    call: interpreted, tl.dot is numpy's BLAS, whose rows change with the row count on some CPUs.)"""
    from specd import LLM, SamplingParams
    from specd.engine.model.linear import TritonInvariantLinear

    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 9)]
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    default = [o.token_ids for o in LLM(llama_dir, dtype="float32").generate(prompts, sp)]
    monkeypatch.setenv("SPECD_FORCE_TRITON", "1")
    llm = LLM(llama_dir, dtype="float32", device=DEVICE)
    linears = [m for m in llm.engine.model.modules() if isinstance(m, TritonInvariantLinear)]
    assert linears
    assert [o.token_ids for o in llm.generate(prompts, sp)] == default
