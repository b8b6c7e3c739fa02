"""Incremental, UTF-8 safe detokenization and stop strings.

The gateway streams text with IncrementalDetokenizer and cuts it with StopStrings (the same
two classes serve streamed and non-streamed responses, so the streamed deltas always join
to exactly the non-streamed text). The engine finds the token that completes a stop string
with StopChecker, over the same detokenizer, so generation ends there and usage counts no
token past it.
"""
from __future__ import annotations

from specd.models.tokenizer import Tokenizer

# Prompt tokens decoded as left context (vLLM uses 5): tokenizers that drop a leading
# space at the start of a string (SentencePiece "▁") then decode the first output token
# as it reads mid-text, and byte-level BPE needs no more than a few bytes of context.
PROMPT_CONTEXT = 5
_PARTIAL = "\ufffd"  # what a decoder makes of an incomplete UTF-8 sequence


class IncrementalDetokenizer:
    """vLLM-style prefix/read offsets over one window of ids.

    Invariant: ids[prefix_offset:read_offset] decodes to text already emitted (or to
    prompt context); a delta is emitted only when decoding past read_offset gives more
    text that does not end in a partial character, so no delta ever carries half of a
    multi-byte character. `flush()` at the end emits whatever is left.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True,
                 keep: frozenset[int] = frozenset()):
        """keep: special tokens that are decoded as their text all the same (tool-call markers the
        parser reads); the other special tokens are dropped here, as decoding would drop them."""
        self._tok = tokenizer
        self._skip = skip_special_tokens and not keep
        self._drop = tokenizer.special_ids - keep if keep and skip_special_tokens else frozenset()
        self._ids = [t for t in prompt_ids[-PROMPT_CONTEXT:] if t not in self._drop]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # everything emitted so far

    def add(self, token_id: int) -> str:
        if token_id in self._drop:
            return ""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix_text = self._tok.decode(self._ids[self._prefix_offset:self._read_offset], self._skip)
        new_text = self._tok.decode(self._ids[self._prefix_offset:], self._skip)
        if len(new_text) <= len(prefix_text) or (new_text.endswith(_PARTIAL) and not final):
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += delta
        return delta


class StopStrings:
    """Cuts the output at the first stop string; the stop string itself is not emitted.

    While streaming, the last len(longest stop) - 1 characters are held back: they
    could be the start of a stop string that the next delta completes.
    """

    def __init__(self, stops: list[str]):
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._text = ""
        self._emitted = 0

    def feed(self, delta: str, final: bool) -> tuple[str, bool]:
        """(text that may be emitted now, whether a stop string was found)."""
        # A match starting earlier than this would have been complete, and found, before.
        start = max(0, len(self._text) - self._hold)
        self._text += delta
        found = [i for i in (self._text.find(s, start) for s in self._stops) if i >= 0]
        if found:
            end, stopped = min(found), True
        else:
            end, stopped = (len(self._text) if final else max(self._emitted, len(self._text) - self._hold)), False
        out = self._text[self._emitted:end]
        self._emitted = end
        return out, stopped


class StopChecker:
    """Engine side: which token completes a stop string (fed every committed token once)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stops: list[str]):
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self.match: int | None = None  # where the first stop string starts in the text, once found

    @property
    def text(self) -> str:
        return self._detok.text

    def add(self, token_id: int) -> bool:
        """True when this token completes a stop string."""
        before = len(self._detok.text)
        if not self._detok.add(token_id):
            return False
        # A match starting earlier than this would have been complete, and found, before.
        start = max(0, before - self._hold)
        found = [i for i in (self._detok.text.find(s, start) for s in self._stops) if i >= 0]
        if found:
            self.match = min(found)
        return bool(found)
