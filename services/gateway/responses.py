"""OpenAI response shapes for chat and text completions, streamed (chunks) or whole."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from specd.models.tokenizer import Tokenizer

from . import tools
from .generation import Step


def usage(last: Step, choices: list[Step] | None = None) -> dict:
    """From the last step; with n choices (the last step of each, in order), their completion tokens
    summed (the prompt counted once, as OpenAI counts it) and the speculation of each."""
    completion = sum(c.completion_tokens for c in choices) if choices else last.completion_tokens
    out = {"prompt_tokens": last.prompt_tokens, "completion_tokens": completion,
           "total_tokens": last.prompt_tokens + completion}
    if choices and len(choices) > 1:
        out["speculative"] = [c.spec for c in choices]
    elif last.spec is not None:
        out["speculative"] = last.spec
    return out


# A token the grammar rules out has logprob -inf, which JSON cannot carry (a whole response was a
# 500, a streamed one sent -Infinity): vLLM's floor instead.
MIN_LOGPROB = -9999.0


@dataclass
class Formatter:
    chat: bool
    request_id: str
    model: str
    tokenizer: Tokenizer
    exact: bool = False  # the verifier's Info.exact, carried by every response object
    tool_names: set[str] | None = None  # chat with tools: calls of these are read back from the text
    tool_format: tools.ToolFormat | None = None  # how the model writes them
    n: int = 1  # choices
    created: int = field(default_factory=lambda: int(time.time()))
    # token id -> its text: the same alternatives come back at position after position
    _texts: dict[int, str] = field(default_factory=dict, init=False, repr=False)
    _calls: dict[int, tools.StreamParser] = field(default_factory=dict, init=False, repr=False)  # by choice
    _last: dict[int, Step] = field(default_factory=dict, init=False, repr=False)  # each choice's last step

    def _envelope(self, choices: list[dict], streamed: bool) -> dict:
        obj = ("chat.completion.chunk" if streamed else "chat.completion") if self.chat else "text_completion"
        # "exact": specd's extension (the openai client keeps it in model_extra): false where greedy
        # output may change with batching or speculation on this server (float32, the torch path, ...).
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "exact": self.exact, "choices": choices}

    def _text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _logprobs(self, token_ids: list[int], logprobs: list[float] | None,
                  tops: list[list[tuple[int, float]]] | None, offsets: list[int]) -> dict | None:
        """tops: per token the requested most likely (id, logprob), best first; None when none were asked."""
        if logprobs is None:
            return None
        tokens = [self._text(t) for t in token_ids]
        logprobs = [max(lp, MIN_LOGPROB) for lp in logprobs]
        tops = [[(i, max(v, MIN_LOGPROB)) for i, v in top] for top in tops or [[] for _ in token_ids]]
        if self.chat:
            return {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode()),
                                 "top_logprobs": [{"token": self._text(i), "logprob": v,
                                                   "bytes": list(self._text(i).encode())} for i, v in top]}
                                for s, lp, top in zip(tokens, logprobs, tops)]}
        return {"tokens": tokens, "token_logprobs": logprobs,
                "top_logprobs": [self._completion_top(s, lp, top) for s, lp, top in zip(tokens, logprobs, tops)],
                "text_offset": offsets}

    def _completion_top(self, chosen: str, logprob: float, top: list[tuple[int, float]]) -> dict[str, float]:
        # OpenAI's legacy API "always returns the logprob of the sampled token, so there may be up
        # to logprobs+1 elements" (as vLLM does): the chosen token comes last when it is not among
        # the most likely, which keeps the dict sorted. Tokens with the same text share one key.
        out: dict[str, float] = {}
        for token_id, value in top:
            out.setdefault(self._text(token_id), value)
        out.setdefault(chosen, logprob)
        return out

    def _choice(self, text: str, logprobs: dict | None, finish: str | None, streamed: bool, index: int = 0) -> dict:
        if not self.chat:
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        body = {"content": text} if streamed else {"role": "assistant", "content": text}
        return {"index": index, ("delta" if streamed else "message"): body, "logprobs": logprobs,
                "finish_reason": finish}

    # ---- streaming

    def role_chunk(self) -> dict | None:
        """The first chat chunk names the role, as OpenAI's does; completions have none."""
        if not self.chat:
            return None
        return self._envelope([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None} for i in range(self.n)], streamed=True)

    def chunk(self, step: Step) -> dict | None:
        """None when the step adds nothing visible (text held back, no logprobs, not finished)."""
        self._last[step.index] = step
        logprobs = self._logprobs(step.token_ids, step.logprobs, step.top_logprobs, step.text_offsets)
        if self.tool_names is not None:
            return self._tool_chunk(step, logprobs)
        if not step.text and logprobs is None and step.finish_reason is None:
            return None
        return self._envelope([self._choice(step.text, logprobs, step.finish_reason, True, step.index)], streamed=True)

    def _tool_chunk(self, step: Step, logprobs: dict | None) -> dict | None:
        """Content outside tool calls as it comes; each call as one tool_calls delta once it closes."""
        parser = self._calls.setdefault(step.index, tools.StreamParser(self.tool_names, self.tool_format))
        before = parser.calls
        text, calls = parser.feed(step.text)
        finish = step.finish_reason
        if finish is not None:
            rest, last = parser.finish()
            text, calls = text + rest, calls + last
            finish = "tool_calls" if finish == "stop" and parser.calls else finish
        if not text and not calls and logprobs is None and finish is None:
            return None
        delta: dict = {"content": text} if text or not calls else {}
        if calls:
            delta["tool_calls"] = [{"index": before + i, **c} for i, c in enumerate(calls)]
        return self._envelope([{"index": step.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
                              streamed=True)

    def usage_chunk(self, last: Step) -> dict:
        return {**self._envelope([], streamed=True), "usage": usage(last, [self._last[i] for i in sorted(self._last)])}

    # ---- whole

    def response(self, steps: list[Step]) -> dict:
        choices = [self._whole([s for s in steps if s.index == i]) for i in range(self.n)]
        lasts = [[s for s in steps if s.index == i][-1] for i in range(self.n)]
        return {**self._envelope(choices, streamed=False), "usage": usage(steps[-1], lasts)}

    def _whole(self, steps: list[Step]) -> dict:
        """One choice from its steps."""
        token_ids = [t for s in steps for t in s.token_ids]
        logprobs = None if steps[-1].logprobs is None else [lp for s in steps for lp in s.logprobs]
        tops = None if steps[-1].top_logprobs is None else [t for s in steps for t in s.top_logprobs]
        offsets = [o for s in steps for o in s.text_offsets]
        text, finish = "".join(s.text for s in steps), steps[-1].finish_reason
        choice = self._choice(text, self._logprobs(token_ids, logprobs, tops, offsets), finish, False, steps[-1].index)
        if self.tool_names is not None:
            content, calls = tools.parse(text, self.tool_names, self.tool_format)
            if calls:
                choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
                choice["finish_reason"] = "tool_calls" if finish == "stop" else finish
        return choice
