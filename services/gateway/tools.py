"""Tool calling in the model's own format: checking the tools, the grammar that forces a call, and
the calls read back from the output.

The format comes from the chat template, as the model was taught it:
- hermes (Qwen2.5, Hermes, many fine-tunes): one block per call, several one per line,
      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>
- llama3_json (Llama 3.1-3.3): the whole answer is one call, {"name": ..., "parameters": {...}},
  which the model may open with its <|python_tag|> token.
tool_choice "auto" lets the model choose and reads calls back from its output; "required" and a
named function constrain the output to calls (a grammar over the declared functions' JSON schemas,
so every call parses and names a declared function); "none" leaves the tools out of the prompt.

Markers that are single tokens of the vocabulary (Qwen2.5's <tool_call> and </tool_call> are
added tokens; Llama's <|python_tag|> is a control token) are what the model emits, so the grammar
forces them as those tokens (llguidance's <[id]>: as text the grammar would allow the marker
token and then refuse it as not being the text's bytes), and the output is decoded with them kept
as text, so the parser sees them even where decoding would drop special tokens.

A model whose chat template does not mention tools (SmolLM2's) cannot be told about them, and a
template whose call format is none of these cannot be read back: both are a 400, not a silent prompt
without tools.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from specd.models.tokenizer import Tokenizer
from specd.structured import JSON_OPTIONS, StructuredOutput

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's function name rule
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolFormat:
    name: str
    open: str  # what starts a call ("" where the call is the whole answer)
    close: str  # what ends it
    args_key: str  # where the arguments go: "arguments" or "parameters"
    parallel: bool  # several calls in one answer, one per line
    marker_ids: dict[str, int]  # marker text -> its token id, for markers that are one token

    def grammar_literal(self, text: str) -> str:
        """The grammar's piece for a marker: its token where it is one, else its text."""
        token = self.marker_ids.get(text)
        return f"<[{token}]>" if token is not None else json.dumps(text)

    @property
    def keep_token_ids(self) -> frozenset[int]:
        """Tokens the output is decoded with, special or not: the markers the parser reads."""
        return frozenset(self.marker_ids.values())


def tool_format(tokenizer: Tokenizer | None) -> ToolFormat | None:
    """The call format the model's chat template teaches; None where it takes no tools or teaches
    none of the formats read here."""
    template = tokenizer.chat_template if tokenizer is not None else None
    if not template or "tools" not in template:
        return None
    if "<tool_call>" in template:
        return _with_markers(tokenizer, ToolFormat("hermes", "<tool_call>", "</tool_call>", "arguments", True, {}))
    if PYTHON_TAG in template or '"parameters"' in template:
        return _with_markers(tokenizer, ToolFormat("llama3_json", "", "", "parameters", False, {}), (PYTHON_TAG,))
    return None


def _with_markers(tokenizer: Tokenizer, fmt: ToolFormat, extra: tuple[str, ...] = ()) -> ToolFormat:
    ids = {}
    for marker in (m for m in (fmt.open, fmt.close, *extra) if m):
        token = tokenizer.added_token_id(marker)
        if token is not None:
            ids[marker] = token
    return ToolFormat(fmt.name, fmt.open, fmt.close, fmt.args_key, fmt.parallel, ids)


def check(tools: list[dict] | None, tool_choice, fmt: ToolFormat | None, template: str | None) -> None:
    """ValueError (a 400 on `tools` or `tool_choice`) for tools or a choice specd cannot serve."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice: requires tools")
        return
    if not template or "tools" not in template:
        raise ValueError("tools: this model's chat template does not take tools (SmolLM2-135M-Instruct's does "
                         "not); serve a model whose template does, such as Qwen2.5-Instruct")
    if fmt is None:
        raise ValueError("tools: this model's chat template teaches a tool-call format specd does not read "
                         "(it reads Hermes/Qwen2.5 <tool_call> blocks and Llama 3.1 JSON calls)")
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type") != "function":
            raise ValueError(f'tools: tools[{i}] must be {{"type": "function", "function": {{...}}}}')
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"tools: tools[{i}].function.name must be 1-64 letters, digits, _ or -")
        if not isinstance(fn.get("parameters", {}), dict):
            raise ValueError(f"tools: tools[{i}].function.parameters must be a JSON schema (an object)")
        names.append(name)
    if len(set(names)) != len(names):
        raise ValueError("tools: function names must be unique")
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
        if name not in names:
            raise ValueError(f"tool_choice: names no declared function ({', '.join(names)})")
    elif tool_choice not in (None, "none", "auto", "required"):
        raise ValueError('tool_choice: must be "none", "auto", "required" or {"type": "function", "function": '
                         '{"name": ...}}')


def forced(tools: list[dict], tool_choice, parallel: bool, fmt: ToolFormat | None) -> StructuredOutput | None:
    """The grammar of calls when the choice forces one ("required" or a named function); None where
    the model may answer in text."""
    if not tools or fmt is None or tool_choice in (None, "none", "auto"):
        return None
    fns = [t["function"] for t in tools]
    if isinstance(tool_choice, dict):
        fns = [f for f in fns if f["name"] == tool_choice["function"]["name"]]
    calls = {"anyOf": [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                         fmt.args_key: f.get("parameters") or {"type": "object"}},
                        "required": ["name", fmt.args_key], "additionalProperties": False} for f in fns],
             "x-guidance": JSON_OPTIONS}  # compact JSON, as response formats get
    several = parallel and fmt.parallel and not isinstance(tool_choice, dict)
    start = 'start: call ("\\n" call)*' if several else "start: call"
    if fmt.open:  # the template's layout: marker, newline, the JSON, newline, marker
        call = f'call: {fmt.grammar_literal(fmt.open)} "\\n" body "\\n" {fmt.grammar_literal(fmt.close)}'
    else:
        call = "call: body"
    return StructuredOutput(grammar=f"{start}\n{call}\nbody: %json {json.dumps(calls)}\n")


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect them: an assistant's tool call arguments as objects
    (OpenAI sends them as JSON text)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c.get("function") or {})
                try:
                    fn["arguments"] = json.loads(fn.get("arguments") or "{}")
                except (TypeError, ValueError):
                    pass  # a template prints it as it came
                calls.append({**c, "function": fn})
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def _call(body: str, names: set[str]) -> dict | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def _blocks(text: str, fmt: ToolFormat):
    return re.finditer(re.escape(fmt.open) + r"\s*(.*?)\s*" + re.escape(fmt.close), text, re.S)


def parse(text: str, names: set[str], fmt: ToolFormat) -> tuple[str | None, list[dict]]:
    """(content outside the calls or None, calls): what does not parse as a call of a declared
    function stays in the content."""
    if not fmt.open:  # the whole answer is the call, or it is content
        body = text.strip()
        call = _call(body.removeprefix(PYTHON_TAG).strip(), names)
        return (None, [call]) if call else (text.replace(PYTHON_TAG, "") if PYTHON_TAG in body else text, [])
    calls, content, last = [], [], 0
    for m in _blocks(text, fmt):
        call = _call(m.group(1), names)
        if call is None:
            continue
        content.append(text[last:m.start()])
        calls.append(call)
        last = m.end()
    content.append(text[last:])
    rest = "".join(content) if calls else text
    return (rest.strip() or None) if calls else rest, calls


class StreamParser:
    """Streamed text -> content deltas and completed calls: text that may begin a call is held
    back until the call closes (emitted as a call) or cannot be one (emitted as content)."""

    def __init__(self, names: set[str], fmt: ToolFormat):
        self.names, self.fmt, self.buffer, self.calls = names, fmt, "", 0
        self._whole: bool | None = None  # llama3_json: whether the answer may be a call (held to the end)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buffer += text
        if not self.fmt.open:
            return self._feed_whole()
        out, calls = "", []
        while self.buffer:
            start = self.buffer.find(self.fmt.open)
            if start < 0:
                keep = _partial(self.buffer, self.fmt.open)  # a tail that may grow into the marker
                out += self.buffer[:len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            out += self.buffer[:start]
            self.buffer = self.buffer[start:]
            end = self.buffer.find(self.fmt.close)
            if end < 0:
                break  # inside a call: wait for its end
            block = self.buffer[:end + len(self.fmt.close)]
            self.buffer = self.buffer[end + len(self.fmt.close):]
            call = _call(block[len(self.fmt.open):-len(self.fmt.close)].strip(), self.names)
            if call is None:
                out += block
            else:
                calls.append(call)
        if calls or self.calls:  # around calls, the separating newlines are not content
            out = out.strip("\n")
        self.calls += len(calls)
        return out, calls

    def _feed_whole(self) -> tuple[str, list[dict]]:
        if self._whole is None:
            head = self.buffer.lstrip()
            if not head or _partial(head, PYTHON_TAG) == len(head):
                return "", []  # not yet known
            self._whole = head.startswith(("{", PYTHON_TAG))
        if self._whole:
            return "", []
        out, self.buffer = self.buffer, ""
        return out, []

    def finish(self) -> tuple[str, list[dict]]:
        """What is left at the end: an unclosed block goes out as content; a whole-answer call is read."""
        rest, self.buffer = self.buffer, ""
        if not self.fmt.open and rest:
            content, calls = parse(rest, self.names, self.fmt)
            self.calls += len(calls)
            return content or "", calls
        return rest, []


def _partial(text: str, marker: str) -> int:
    """The length of text's tail that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
