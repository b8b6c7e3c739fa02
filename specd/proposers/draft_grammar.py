"""Drafter-side structured output: a model drafter masks its own drafts with the request's grammar.

The verifier alone keeps output exact (it cuts drafts at the first refused token and masks the
target's distribution, specd/engine/grammar.py); a drafter that drafts outside the grammar only
wastes its draft there. So a model drafter (draft_model chains, the hidden-state heads) that gets
a request's structured output keeps its own matcher per sequence, advanced by committed tokens
only, and masks each draft's logits with the state after the drafts before it; the drafted
tokens are rolled back after the call. Sampled drafts are drawn from the masked distribution,
which is then the q the verifier is sent, so acceptance stays exact.

A chain stops after a draft that ends the grammar (EOS) or leaves it. Not masked: token trees and
pipelined (tentative) requests; a state the drafter's own vocabulary cannot follow (nothing
allowed) drafts unmasked, and the verifier cuts it.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch


class DraftGrammars:
    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: list[int], enabled: bool = True):
        self.model_dir, self.vocab_size, self.eos_token_ids = Path(model_dir), vocab_size, eos_token_ids
        self.enabled = enabled
        self._grammars = None  # specd.engine.grammar.Grammars, made on the first constrained request
        self.matchers: dict[int, object] = {}  # seq_id -> matcher at the committed state
        self.drafted: dict[int, int] = {}  # seq_id -> tokens consumed by this call's drafts
        self.off: set[int] = set()  # sequences whose draft left the grammar in this call: unmasked from there

    def sync(self, seq_id: int, structured: str | None, history: list[int], num_prompt_tokens: int | None,
             full: bool) -> None:
        """After the proposer applied a committed delta: a full history (re)starts the sequence's
        matcher from `structured` (JSON of a StructuredOutput, sent with full histories only);
        otherwise `history` holds just the new committed tokens."""
        if full:
            self.matchers.pop(seq_id, None)
            if not (self.enabled and structured and num_prompt_tokens is not None):
                return
            matcher = self._matcher(structured)
            if matcher is None:
                return
            self.matchers[seq_id] = matcher
            history = history[num_prompt_tokens:]
        matcher = self.matchers.get(seq_id)
        if matcher is not None and history and not matcher.consume_tokens(list(history)):
            del self.matchers[seq_id]  # the committed text left our grammar: stop masking it

    def mask(self, seq_ids: list[int | None], logits: torch.Tensor,
             token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """logits [n, V_head], row i drafting for seq_ids[i] (None: not to be masked), with each
        constrained row masked by its sequence's state, in one pass (a new tensor where any row
        is). A state that allows nothing the head can draft leaves its row as it was.
        token_ids: head index -> target id, for heads with a draft vocabulary (EAGLE-3's d2t)."""
        rows = [i for i, s in enumerate(seq_ids) if s in self.matchers and s not in self.off]
        if not rows:
            return logits
        allowed = self._grammars.allowed([self.matchers[seq_ids[i]] for i in rows]).to(logits.device)
        allowed = allowed[:, token_ids] if token_ids is not None else allowed[:, : logits.shape[-1]]
        allowed[~allowed.any(dim=1)] = True
        index = torch.tensor(rows, device=logits.device)
        out = logits.clone()
        out[index] = logits[index].masked_fill(~allowed, float("-inf"))
        return out

    def push(self, seq_id: int, token: int) -> None:
        """A draft: advance the sequence's matcher past it (undone by end_call)."""
        matcher = self.matchers.get(seq_id)
        if matcher is None or seq_id in self.off:
            return
        if matcher.is_accepting() and token in self.eos_token_ids or not matcher.try_consume_tokens([token]):
            self.off.add(seq_id)  # the draft ended (EOS) or left the grammar: nothing after it to mask
        else:
            self.drafted[seq_id] = self.drafted.get(seq_id, 0) + 1

    def stopped(self, seq_id: int) -> bool:
        """The sequence's last draft ended the grammar (EOS) or left it: chains stop drafting there
        (nothing after it can be accepted)."""
        return seq_id in self.off

    def end_call(self) -> None:
        """Roll every matcher back to its committed state."""
        for seq_id, n in self.drafted.items():
            matcher = self.matchers.get(seq_id)
            if matcher is not None:
                matcher.rollback(n)
        self.drafted.clear()
        self.off.clear()

    def release(self, seq_ids: list[int]) -> None:
        for sid in seq_ids:
            self.matchers.pop(sid, None)

    def _matcher(self, structured: str):
        from specd.structured import StructuredOutput

        if self._grammars is None:
            from specd.engine.grammar import Grammars

            path = self.model_dir / "tokenizer.json"
            if not path.is_file():
                self.enabled = False  # no tokenizer here: draft unmasked, the verifier still cuts
                return None
            self._grammars = Grammars(path, self.vocab_size, self.eos_token_ids)
        try:
            return self._grammars.matcher(StructuredOutput.from_dict(json.loads(structured)))
        except (ValueError, TypeError):
            return None  # the verifier accepted it; a grammar we cannot build here just goes unmasked
