"""Structured output: the allowed tokens of each constrained row of a step, from llguidance.

Why llguidance (bench/results/grammar_engines.md, this CPU, the default tokenizer, 22 schemas):
it compiles a JSON schema in about 0.5 ms (7.5 ms at most) where xgrammar takes 406 ms (2.0 s at
most; strings with a maxLength cost it most), so a request's new schema costs no time to first
token; the mask per token is about 0.1 ms for both (mean 96 vs 124 us), under 1% of a decode step. It also reads the
model's tokenizer.json directly (serving installs no transformers), takes regexes and Lark
grammars, and its matcher rolls back, which speculation needs.

How speculation stays lossless with a grammar (the target's distribution is the masked one):
- cut_drafts: a draft is walked through the request's matcher; the first token the grammar
  refuses ends it. That token stays as the last draft: the masked target gives it probability
  0, so it is always rejected and the token drawn there comes from the residual
  norm(max(p' - q, 0)), which sampled drafts need for exactness (sampling from p' instead
  would not be); the drafts after it could never be reached and go.
- mask: every logits row of a constrained sequence, draft positions and the bonus position
  alike, is masked with the grammar state after the drafts before it (token trees: after the
  path to the node); rows of refused drafts are never read and stay unmasked.
- advance: after sampling, only the committed tokens advance the matcher: it never holds
  a rejected draft, so there is nothing to roll back.
"""
from __future__ import annotations

import functools
import time
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path

import torch

from specd.kernels.tree_rejection_sampler import path_to
from specd.structured import StructuredOutput, grammar_text

COMPILED_CACHE = 256  # grammars kept compiled (a schema sent again is copied, not compiled)


class Grammars:
    """One model's grammar engine: its tokenizer for llguidance and compiled grammars by request."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: list[int]):
        import llguidance

        self.vocab_size, self.eos_token_ids = vocab_size, sorted(eos_token_ids)
        self.tokenizer = llguidance.LLTokenizer(str(tokenizer_json), n_vocab=vocab_size,
                                                eos_token=sorted(eos_token_ids) or None)
        self._compiled: OrderedDict = OrderedDict()  # StructuredOutput -> its matcher at the start
        self.words = (vocab_size + 31) // 32

    def matcher(self, s: StructuredOutput):
        """A matcher for s at its start: a copy of the one compiled for s the first time it came
        (ValueError where the grammar does not compile)."""
        import llguidance

        start = self._compiled.pop(s, None)
        if start is None:
            start = llguidance.LLMatcher(self.tokenizer, grammar_text(s), log_level=0)
            if start.is_error():
                raise ValueError(f"structured output: {start.get_error()}")
        self._compiled[s] = start  # most recently used last
        while len(self._compiled) > COMPILED_CACHE:
            self._compiled.popitem(last=False)
        return start.deep_copy()

    def allowed(self, matchers: list) -> torch.Tensor:
        """bool [len(matchers), vocab_size]: the tokens each matcher allows next (a drafter masking
        its own drafts)."""
        buf = torch.full((len(matchers), self.words), -1, dtype=torch.int32)
        for i, m in enumerate(matchers):
            fill_row(m, buf, i)
        return unpack(buf, self.vocab_size)

    # -- a step ----------------------------------------------------------------
    @staticmethod
    def cut_drafts(matcher, token_ids: list[int], parents: list[int] | None) -> list[int]:
        """The draft nodes to keep (indices, in order): every node the grammar allows after its
        path, and the first refused node of each path (always rejected; see the module
        docstring). Nodes below a refused one are unreachable and go."""
        if parents is None:
            return list(range(min(matcher.validate_tokens(token_ids) + 1, len(token_ids))))
        keep, allowed = [], {}
        for i, p in enumerate(parents):
            if p >= 0 and not allowed.get(p, False):
                continue
            path = [token_ids[j] for j in path_to(i, parents)]
            allowed[i] = matcher.validate_tokens(path) == len(path)
            keep.append(i)
        return keep

    def fill_masks(self, matcher, token_ids: list[int], parents: list[int], out: torch.Tensor) -> None:
        """out [1 + n, words] int32, all-allowed on entry: row 0 the tokens allowed now, row 1 + i
        those after the path to draft node i (a refused node's row is never read: left as is)."""
        fill_row(matcher, out, 0)
        for i in range(len(token_ids)):
            path = [token_ids[j] for j in path_to(i, parents)]
            if matcher.validate_tokens(path) == len(path) and matcher.consume_tokens(path):
                fill_row(matcher, out, 1 + i)
                matcher.rollback(len(path))

    def cut_batch_drafts(self, batch, drafts: dict, timings) -> None:
        """drafts (Drafts by seq_id, before the scheduler attaches them): constrained sequences'
        drafts cut where the grammar refuses (cut_drafts), parents renumbered, q kept per node."""
        t = time.perf_counter()
        for e in batch:
            d = drafts.get(e.seq.seq_id)
            if e.seq.matcher is None or d is None:
                continue
            keep = self.cut_drafts(e.seq.matcher, d.token_ids, d.parents)
            if len(keep) == len(d.token_ids):
                continue
            if not keep:
                del drafts[e.seq.seq_id]
                continue
            new = {old: i for i, old in enumerate(keep)}
            drafts[e.seq.seq_id] = replace(
                d, token_ids=[d.token_ids[i] for i in keep], q=[d.q[i] for i in keep] if d.q else d.q,
                parents=None if d.parents is None else [new.get(d.parents[i], -1) for i in keep])
        timings.mask_s += time.perf_counter() - t

    def mask_batch(self, batch, logits: torch.Tensor, timings) -> None:
        """The step's logits [R, V] in place: every row of a constrained sequence masked with its
        grammar state (one bitmask buffer for the step's constrained rows)."""
        from specd.kernels.tree_rejection_sampler import chain_parents

        t = time.perf_counter()
        rows, parts, r = [], [], 0
        for e in batch:
            if not e.num_logits:
                continue
            if e.seq.matcher is not None:
                n = len(e.draft_token_ids)
                part = torch.full((1 + n, self.words), -1, dtype=torch.int32)
                if n:
                    self.fill_masks(e.seq.matcher, e.draft_token_ids, e.drafts.parents or chain_parents(n), part)
                else:
                    fill_row(e.seq.matcher, part, 0)
                rows += range(r + e.num_logits - 1 - n, r + e.num_logits)
                parts.append(part)
            r += e.num_logits
        if rows:
            bitmask = torch.cat(parts)
            # A state that allows nothing (a matcher in error) still lets the row end: EOS only.
            empty = (bitmask == 0).all(dim=1)
            if bool(empty.any()):
                for eos in self.eos_token_ids:
                    bitmask[empty, eos // 32] |= int(_bits()[eos % 32])
            self.apply(logits, rows, bitmask)
            timings.masked_rows += len(rows)
        timings.mask_s += time.perf_counter() - t

    @staticmethod
    def advance(batch, token_ids: list[list[int]]) -> None:
        """The committed tokens of each sampled constrained sequence into its matcher."""
        for e, tokens in zip((e for e in batch if e.num_logits), token_ids):
            if e.seq.matcher is not None and tokens:
                e.seq.matcher.consume_tokens(tokens)

    def apply(self, logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
        """logits [R, V] in place: -inf where bitmask's rows (for logits rows `rows`) refuse a token."""
        allowed = unpack(bitmask, logits.shape[-1]).to(logits.device)
        index = torch.tensor(rows, device=logits.device)
        with torch.inference_mode():  # the forward's logits are inference tensors
            logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def fill_row(matcher, bitmask: torch.Tensor, i: int) -> None:
    """Row i of bitmask (int32, CPU, contiguous rows) := the tokens matcher allows next. What
    llguidance.torch.fill_next_token_bitmask does, without importing that module: its
    torch.compile decorator imports torch._dynamo (2.5 s on the first constrained request)."""
    row = bitmask[i]
    assert bitmask.dtype == torch.int32 and row.is_contiguous() and not row.is_cuda
    matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)


def unpack(bitmask: torch.Tensor, n: int) -> torch.Tensor:
    """bool [rows, n] from llguidance's bitmask [rows, words] int32 (bit b of word w: token 32w + b):
    its bytes (little-endian) looked up in a 256 x 8 table."""
    rows = bitmask.shape[0]
    return _byte_bits()[bitmask.contiguous().view(torch.uint8).long()].reshape(rows, -1)[:, :n]


@functools.cache
def _byte_bits() -> torch.Tensor:
    return (torch.arange(256)[:, None] >> torch.arange(8)) & 1 == 1  # [256, 8]: bit j of byte x


@functools.cache
def _bits() -> torch.Tensor:
    return torch.tensor([1 << b for b in range(31)] + [-(1 << 31)], dtype=torch.int32)

