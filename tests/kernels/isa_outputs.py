"""The fused CPU ops' outputs on fixed inputs, for tests/kernels/test_isa_builds.py to compare
across builds. Run in a subprocess with SPECD_CPU_ISA set (one build per process: every build
registers the same torch.ops.specd_cpu names):

    python tests/kernels/isa_outputs.py OUT.pt MODEL_DIR...
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

# (rows, K, N) of the bf16 matmul: decode rows and verify blocks, an odd K (a last half pair), N not a multiple of 16,
# wide outputs (the tiles' column loops) and many rows (the block tiles)
LINEAR_SHAPES = [(1, 576, 1536), (2, 577, 47), (5, 64, 1000), (16, 960, 576), (33, 128, 130)]


def main(out: str, model_dirs: list[str]) -> None:
    torch.set_num_threads(1)
    from specd.kernels import cpu_ops

    if not cpu_ops.available():
        raise SystemExit("the fused CPU ops did not build")
    from specd import LLM, SamplingParams

    g = torch.Generator().manual_seed(0)
    res = {"isa": cpu_ops.isa()}
    for m, k, n in LINEAR_SHAPES:
        x = torch.randn(m, k, generator=g).bfloat16()
        w = torch.randn(n, k, generator=g).bfloat16()
        packed = torch.ops.specd_cpu.pack_linear_weight(w)
        res[f"linear {m}x{k}x{n}"] = torch.ops.specd_cpu.linear(x, packed, torch.randn(n, generator=g), n)
    # The GGUF-quantized matmul, every type: K = 512 and, for the 32-weight types, 544 (an odd count
    # of blocks, which the AVX-512 path, taking blocks in pairs, ends alone); 5 rows (a tile and one)
    from test_cpu_quant_matmul import TYPES, blocks, packed_from
    from specd.engine.model.quant import KERNEL_TYPES

    with tempfile.TemporaryDirectory() as tmp:
        for q in TYPES:
            for k in (512, 544):
                if k % KERNEL_TYPES[int(q)][0] == 0:
                    packed = packed_from(Path(tmp), [(q, blocks(q, 37, k))])
                    x = torch.randn(5, k, generator=g).bfloat16()
                    res[f"linear quant {q.name} {k}"] = torch.ops.specd_cpu.quant_linear(x, packed, None, True)
    # The whole forward (decoder_stack, attention, norms, rotary): greedy with ngram drafts, so
    # verify blocks, mixed batches and prefill chunks all run.
    prompts = [[(7 * i + j) % 200 + 3 for j in range(5 + 3 * i)] * 2 for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=True)
    for d in model_dirs:
        llm = LLM(d, dtype="bfloat16", speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                           "prompt_lookup_min": 1, "adaptive": False})
        res[d] = [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]
    torch.save(res, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
