"""The Responses API's output: the `response` object, whole or as the typed SSE events the official
client parses (response.created ... response.completed, each with its sequence_number).

Text goes in a `message` item's `output_text` part; with tools in play, calls the model wrote (read
back by tools.py, as chat's tool_calls are) become `function_call` items after it. A response cut by
max_output_tokens is `incomplete` with incomplete_details.reason "max_output_tokens".
"""
from __future__ import annotations

import contextlib
import itertools
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from . import tools
from .errors import APIError
from .generation import Step


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(last: Step) -> dict:
    # cached_tokens: the verifier does not report prefix-cache hits per request
    out = {"input_tokens": last.prompt_tokens, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
           "output_tokens": last.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
           "total_tokens": last.prompt_tokens + last.completion_tokens}
    if last.spec is not None:
        out["speculative"] = last.spec  # specd's extension, as chat's usage.speculative
    return out


def _message(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [_part(text)]}


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _function_call(call: dict) -> dict:
    """A chat tool call (tools.py's) as a function_call item."""
    return {"type": "function_call", "id": _id("fc"), "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": "completed"}


@dataclass
class ResponsesFormatter:
    request_id: str
    model: str
    echo: dict  # the request's settings the response object repeats (ResponsesRequest.echo)
    exact: bool = False  # the verifier's Info.exact, as chat's responses carry it
    tool_names: set[str] | None = None  # calls of these are read back from the text
    tool_format: tools.ToolFormat | None = None
    created_at: int = field(default_factory=lambda: int(time.time()))

    def _object(self, status: str, output: list[dict], last: Step | None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.request_id, "object": "response", "created_at": self.created_at, "status": status,
                "error": None, "incomplete_details": incomplete, "model": self.model, "output": output,
                "usage": usage(last) if last is not None else None, "exact": self.exact, **self.echo}

    @staticmethod
    def _status(finish: str | None) -> str:
        return "incomplete" if finish == "length" else "completed"

    def response(self, steps: list[Step]) -> dict:
        text, status = "".join(s.text for s in steps), self._status(steps[-1].finish_reason)
        content, calls = tools.parse(text, self.tool_names, self.tool_format) if self.tool_names else (text, [])
        output = [_message(_id("msg"), content or "", status)] if content or not calls else []
        return self._object(status, output + [_function_call(c) for c in calls], steps[-1])

    async def events(self, first: Step, steps: AsyncIterator[Step]) -> AsyncIterator[bytes]:
        """The SSE body: `event: TYPE` + `data: {...}` per event, as OpenAI sends them (no [DONE])."""
        numbers = itertools.count()

        def frame(event: dict) -> bytes:
            event["sequence_number"] = next(numbers)
            data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
            return f"event: {event['type']}\ndata: {data}\n\n".encode()

        async with contextlib.aclosing(steps):
            for kind in ("response.created", "response.in_progress"):
                yield frame({"type": kind, "response": self._object("in_progress", [], None)})
            items = _Items(self.tool_names, self.tool_format)
            step = first
            try:
                while True:
                    for event in items.feed(step):
                        yield frame(event)
                    if step.finish_reason is not None:
                        break
                    step = await anext(steps)
                status = self._status(step.finish_reason)
                for event in items.finish(status):
                    yield frame(event)
                kind = "response.completed" if status == "completed" else "response.incomplete"
                yield frame({"type": kind, "response": self._object(status, items.output, step)})
            except APIError as e:  # the status line is gone; the error travels as an event (as OpenAI's)
                yield frame({"type": "error", "code": e.code, "message": e.message, "param": e.param})


class _Items:
    """Output items as they stream: text opens a message item (at once without tools, at its first
    text with them) that a function call closes; each call is one item, its arguments in one delta."""

    def __init__(self, tool_names: set[str] | None, tool_format: tools.ToolFormat | None):
        self.output: list[dict] = []  # finished items, in output order
        self.parser = tools.StreamParser(tool_names, tool_format) if tool_names else None
        self.message: tuple[str, list[str]] | None = None  # the open message: its id and text so far

    def feed(self, step: Step) -> list[dict]:
        if self.parser is None:
            return self._text(step.text) if step.text or self.message is None else []  # opened at once
        text, calls = self.parser.feed(step.text)
        if step.finish_reason is not None:
            rest, last = self.parser.finish()
            text, calls = text + rest, calls + last
        events = self._text(text) if text else []
        for call in calls:
            events += self._close("completed") + self._call(_function_call(call))
        return events

    def finish(self, status: str) -> list[dict]:
        events = self._text("") if not self.output and self.message is None else []  # never an empty output
        return events + self._close(status)

    def _text(self, delta: str) -> list[dict]:
        events = []
        if self.message is None:
            self.message = (_id("msg"), [])
            where = {"item_id": self.message[0], "output_index": len(self.output)}
            events += [{"type": "response.output_item.added", "output_index": len(self.output),
                        "item": {**_message(self.message[0], "", "in_progress"), "content": []}},
                       {"type": "response.content_part.added", **where, "content_index": 0, "part": _part("")}]
        if delta:
            self.message[1].append(delta)
            events.append({"type": "response.output_text.delta", "item_id": self.message[0],
                           "output_index": len(self.output), "content_index": 0, "delta": delta, "logprobs": []})
        return events

    def _close(self, status: str) -> list[dict]:
        if self.message is None:
            return []
        (item_id, texts), self.message = self.message, None
        text, where = "".join(texts), {"item_id": item_id, "output_index": len(self.output), "content_index": 0}
        item = _message(item_id, text, status)
        self.output.append(item)
        return [{"type": "response.output_text.done", **where, "text": text, "logprobs": []},
                {"type": "response.content_part.done", **where, "part": _part(text)},
                {"type": "response.output_item.done", "output_index": where["output_index"], "item": item}]

    def _call(self, item: dict) -> list[dict]:
        index, where = len(self.output), {"item_id": item["id"], "output_index": len(self.output)}
        self.output.append(item)
        return [{"type": "response.output_item.added", "output_index": index,
                 "item": {**item, "arguments": "", "status": "in_progress"}},
                {"type": "response.function_call_arguments.delta", **where, "delta": item["arguments"]},
                {"type": "response.function_call_arguments.done", **where, "name": item["name"],
                 "arguments": item["arguments"]},
                {"type": "response.output_item.done", "output_index": index, "item": item}]
