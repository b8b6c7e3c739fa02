"""The load-time self-test of batch-invariant mode: the real forward, in the layouts the engine produces.

Greedy output is the same with and without speculation only if a token's logits do not depend on
what else its step computes. Whether they do is a property of the kernels on this machine (dtype,
ISA, thread count): oneDNN's bfloat16 matmul changed a row's last bit between 1 and 4 rows on an
AMD EPYC while passing a check of each matmul shape alone. So this runs the model itself
(ModelRunner.run, on a small private KV cache) and compares logits bitwise:
  - a sequence decoded one token per step, alone (the reference);
  - the same tokens as one verify block (k + 1 rows), and as a token tree with side branches;
  - its prompt prefilled in two chunks beside another sequence's prefill and decode rows, then its
    verify block in a step that also carries a third sequence's prefill chunk.
On CUDA, attention must be the Triton kernel (invariant by construction): the torch path passed
these layouts on an H200 and still changed greedy tokens in a batch of 16 (and in a wider probe
step of 12 decode rows and a 64-token chunk, tried and dropped for it), so it is refused outright.
Any difference names the layout; the engine then turns the mode off and reports exact = false.
"""
from __future__ import annotations

import torch

from specd.engine.model.attention import triton_attention_used
from specd.engine.model.decoder import CausalLM
from specd.engine.model_runner import ModelRunner
from specd.engine.scheduler import ScheduledSeq
from specd.engine.sequence import Sequence
from specd.sampling import SamplingParams

BLOCK_SIZE = 16
PROMPTS = (37, 29, 23)  # not block multiples: partial blocks and ragged rows (shorter where positions run out)
CHAIN = 4  # continuation tokens: verify blocks of CHAIN + 1 rows, as k = 4 speculation makes


class _Probe:
    """Sequences with hand-set block tables on one private cache, stepped through ModelRunner.run."""

    def __init__(self, model: CausalLM):
        self.runner = ModelRunner(model, 24, BLOCK_SIZE, model.model.embed_tokens.weight.device,
                                  model.model.embed_tokens.weight.dtype)
        self.next_block = 0

    def sequence(self, tokens: list[int]) -> Sequence:
        seq = Sequence(tokens, SamplingParams())
        blocks = -(-(len(tokens) + 2) // BLOCK_SIZE)
        seq.block_table = list(range(self.next_block, self.next_block + blocks))[::-1]  # not contiguous
        self.next_block += blocks
        return seq

    def step(self, *entries: ScheduledSeq) -> list[torch.Tensor]:
        logits = self.runner.run(list(entries)).split([e.num_logits for e in entries])
        for e in entries:
            e.seq.num_computed_tokens += e.num_new_tokens
        return logits


def forward_invariance_failures(model: CausalLM) -> list[str]:
    """The layouts in which a row's logits differed from the same row decoded alone (empty: none)."""
    device = model.model.embed_tokens.weight.device
    if device.type == "cuda" and not triton_attention_used(device):
        # Not by construction, and not caught by the layouts below: on an H200 the torch path passed
        # them all and still changed 15 of 16 prompts' greedy tokens in a batch (bench/results/gpu_exact.md).
        return ["attention on CUDA takes the torch path (SPECD_PAGED_ATTENTION=torch, or Triton missing), whose "
                "cuBLAS and softmax kernels are chosen by shape"]
    room = model.rotary.max_positions - CHAIN - 1
    PROMPT, OTHER_PROMPT, THIRD_PROMPT = (min(n, room) for n in PROMPTS)
    if PROMPT < 3:
        return []  # a model of a few positions: nothing to lay out
    g = torch.Generator().manual_seed(0)
    prompt, chain, side, other, third = (torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
                                         for n in (PROMPT, CHAIN, 2, OTHER_PROMPT, THIRD_PROMPT))
    failures = []

    def compare(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not torch.equal(got, want):
            failures.append(f"{what} (largest logit difference {(got - want).abs().max().item():.3g})")

    with torch.inference_mode():
        # Alone: prefill all but the last prompt token, then one row per step.
        probe = _Probe(model)
        seq = probe.sequence(prompt + chain)
        probe.step(ScheduledSeq(seq, PROMPT - 1, 0))
        alone = torch.cat([probe.step(ScheduledSeq(seq, 1, 1))[0] for _ in range(CHAIN + 1)])

        seq = probe.sequence(prompt + chain)
        probe.step(ScheduledSeq(seq, PROMPT - 1, 0))
        compare(f"a {CHAIN + 1}-row verify block vs its rows decoded alone",
                probe.step(ScheduledSeq(seq, CHAIN + 1, CHAIN + 1))[0], alone)

        # A tree over [last prompt token, chain...] with a side branch at the first two nodes; the
        # chain's rows sit at slots 0, 1, 3, 5 of the tree.
        tree = [prompt[-1], chain[0], side[0], chain[1], side[1], chain[2], chain[3]]
        parents = [-1, 0, 0, 1, 1, 3, 5]
        seq = probe.sequence(prompt[:-1] + tree)
        probe.step(ScheduledSeq(seq, PROMPT - 1, 0))
        rows = probe.step(ScheduledSeq(seq, len(tree), len(tree), tree_base=PROMPT - 1, tree_parents=parents))[0]
        compare("a token tree's path vs its rows decoded alone", rows[[0, 1, 3, 5, 6]], alone)

        # Mixed steps: chunked prefill beside another sequence's prefill and decode rows.
        seq, b, c = probe.sequence(prompt + chain), probe.sequence(other + [0]), probe.sequence(third)
        first = PROMPT // 3
        probe.step(ScheduledSeq(seq, first, 0), ScheduledSeq(b, OTHER_PROMPT, 1))
        probe.step(ScheduledSeq(b, 1, 1), ScheduledSeq(seq, PROMPT - 1 - first, 0))
        mixed = probe.step(ScheduledSeq(c, THIRD_PROMPT, 1), ScheduledSeq(seq, CHAIN + 1, CHAIN + 1))[1]
        compare("a verify block in a step with other sequences' prefill chunks vs its rows decoded alone",
                mixed, alone)
    return failures
