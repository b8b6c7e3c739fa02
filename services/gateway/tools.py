"""Tool calling: checking the tools, the grammar that forces a call, and the calls read back from text.

The calls are written the way Hermes-style chat templates (Qwen2.5, Hermes, many fine-tunes)
teach the model: one block per call,
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
and several blocks one per line for parallel calls. tool_choice "auto" lets the model choose and
reads the blocks back from its text; "required" and a named function constrain the output to such
blocks (a grammar over the declared functions' JSON schemas, so every call parses and names a
declared function); "none" leaves the tools out of the prompt. A model whose chat template does
not mention tools (SmolLM2's) cannot be told about them: that is a 400, not a silent prompt
without them.
"""
from __future__ import annotations

import json
import re
import uuid

from specd.structured import JSON_OPTIONS, StructuredOutput

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's function name rule


def check(tools: list[dict] | None, tool_choice, template: str | None) -> None:
    """ValueError (a 400 on `tools` or `tool_choice`) for tools or a choice specd cannot serve."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice: requires tools")
        return
    if not template or "tools" not in template:
        raise ValueError("tools: this model's chat template does not take tools (SmolLM2-135M-Instruct's does "
                         "not); serve a model whose template does, such as Qwen2.5-Instruct")
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


def forced(tools: list[dict], tool_choice, parallel: bool) -> StructuredOutput | None:
    """The grammar of tool-call blocks when the choice forces a call ("required" or a named
    function); None where the model may answer in text."""
    if not tools or tool_choice in (None, "none", "auto"):
        return None
    fns = [t["function"] for t in tools]
    if isinstance(tool_choice, dict):
        fns = [f for f in fns if f["name"] == tool_choice["function"]["name"]]
    calls = {"anyOf": [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                         "arguments": f.get("parameters") or {"type": "object"}},
                        "required": ["name", "arguments"], "additionalProperties": False} for f in fns],
             "x-guidance": JSON_OPTIONS}  # compact JSON, as response formats get
    start = "start: call (\"\\n\" call)*" if parallel and not isinstance(tool_choice, dict) else "start: call"
    lark = f'{start}\ncall: "{OPEN}\\n" body "\\n{CLOSE}"\nbody: %json {json.dumps(calls)}\n'
    return StructuredOutput(grammar=lark)


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


def parse(text: str, names: set[str]) -> tuple[str | None, list[dict]]:
    """(content outside the calls or None, calls): blocks that do not parse as a call of a
    declared function stay in the content."""
    calls, content, last = [], [], 0
    for m in _BLOCK.finditer(text):
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

    def __init__(self, names: set[str]):
        self.names, self.buffer, self.calls = names, "", 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buffer += text
        out, calls = "", []
        while self.buffer:
            start = self.buffer.find(OPEN)
            if start < 0:
                keep = _partial_open(self.buffer)  # a tail that may grow into "<tool_call>"
                out += self.buffer[:len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            out += self.buffer[:start]
            self.buffer = self.buffer[start:]
            end = self.buffer.find(CLOSE)
            if end < 0:
                break  # inside a call: wait for its end
            block = self.buffer[:end + len(CLOSE)]
            self.buffer = self.buffer[end + len(CLOSE):]
            call = _call(block[len(OPEN):-len(CLOSE)].strip(), self.names)
            if call is None:
                out += block
            else:
                calls.append(call)
        if calls or self.calls:  # around calls, the separating newlines are not content
            out = out.strip("\n")
        self.calls += len(calls)
        return out, calls

    def finish(self) -> str:
        """What is left at the end (an unclosed block) goes out as content."""
        rest, self.buffer = self.buffer, ""
        return rest


def _partial_open(text: str) -> int:
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
