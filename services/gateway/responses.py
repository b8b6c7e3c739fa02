"""OpenAI response shapes for chat and text completions, streamed (chunks) or whole."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from specd.tokenizer import Tokenizer

from .generation import Step


def usage(last: Step) -> dict:
    out = {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
           "total_tokens": last.prompt_tokens + last.completion_tokens}
    if last.spec is not None:
        out["speculative"] = last.spec
    return out


@dataclass
class Formatter:
    chat: bool
    request_id: str
    model: str
    tokenizer: Tokenizer
    created: int = field(default_factory=lambda: int(time.time()))

    def _envelope(self, choices: list[dict], streamed: bool) -> dict:
        obj = ("chat.completion.chunk" if streamed else "chat.completion") if self.chat else "text_completion"
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def _logprobs(self, token_ids: list[int], logprobs: list[float] | None, offsets: list[int]) -> dict | None:
        if logprobs is None:
            return None
        # Only the chosen token's logprob is known (no top alternatives), so top_logprobs stay empty.
        tokens = [self.tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]
        if self.chat:
            return {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
                                for s, lp in zip(tokens, logprobs)]}
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": [{} for _ in tokens],
                "text_offset": offsets}

    def _choice(self, text: str, logprobs: dict | None, finish: str | None, streamed: bool) -> dict:
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        body = {"content": text} if streamed else {"role": "assistant", "content": text}
        return {"index": 0, ("delta" if streamed else "message"): body, "logprobs": logprobs,
                "finish_reason": finish}

    # ---- streaming

    def role_chunk(self) -> dict | None:
        """The first chat chunk names the role, as OpenAI's does; completions have none."""
        if not self.chat:
            return None
        return self._envelope([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}], streamed=True)

    def chunk(self, step: Step) -> dict | None:
        """None when the step adds nothing visible (text held back, no logprobs, not finished)."""
        logprobs = self._logprobs(step.token_ids, step.logprobs, step.text_offsets)
        if not step.text and logprobs is None and step.finish_reason is None:
            return None
        return self._envelope([self._choice(step.text, logprobs, step.finish_reason, streamed=True)], streamed=True)

    def usage_chunk(self, last: Step) -> dict:
        return {**self._envelope([], streamed=True), "usage": usage(last)}

    # ---- whole

    def response(self, steps: list[Step]) -> dict:
        token_ids = [t for s in steps for t in s.token_ids]
        logprobs = None if steps[-1].logprobs is None else [lp for s in steps for lp in s.logprobs]
        offsets = [o for s in steps for o in s.text_offsets]
        choice = self._choice("".join(s.text for s in steps), self._logprobs(token_ids, logprobs, offsets),
                              steps[-1].finish_reason, streamed=False)
        return {**self._envelope([choice], streamed=False), "usage": usage(steps[-1])}
