"""OpenAI's Responses API request (POST /v1/responses), served statelessly by translation to a
chat completion request: the same template, tools in the model's own format, structured output,
speculation and stop handling as /v1/chat/completions.

Input items map to chat messages: a message to a message (its text parts joined as chat joins
them), consecutive `function_call` items to one assistant message with `tool_calls`, a
`function_call_output` to a `tool` message; `instructions` is a system message first. What needs
stored state (`store: true`, `previous_response_id`, `conversation`, `background`, stored
`prompt`s) is a 400, as is every field that would change the output but is not implemented
here (`top_logprobs`, `reasoning`, `truncation: "auto"`, ...), named.
"""
from __future__ import annotations

import contextlib
import json
import re
from typing import Any, Iterator, Literal

from pydantic import ValidationError

from .errors import APIError, bad_request
from .schemas import ChatCompletionRequest, GenerationFields, ToolFields, _Body

# OpenAI's metadata limits: 16 pairs, keys to 64 characters, values to 512.
MAX_METADATA = (16, 64, 512)
STATELESS = ("this server is stateless: it keeps no responses or conversations; send the whole "
             "conversation in `input` (earlier output items may go back as input items)")
# include values with nothing to include here (no reasoning items are ever produced)
_INCLUDE_NOTHING = {"reasoning.encrypted_content"}
# chat field -> the Responses field it came from, for errors the chat pipeline raises
_CHAT_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
               "response_format": "text.format"}
_CHAT_WORDS = re.compile(r"\b(" + "|".join(_CHAT_NAMES) + r")\b")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function and schema names


class TextConfig(_Body):
    format: dict | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesStreamOptions(_Body):
    include_obfuscation: bool | None = None  # random padding against length side channels: not added here


class ResponsesRequest(GenerationFields, ToolFields):
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: int | None = None
    stream_options: ResponsesStreamOptions | None = None
    text: TextConfig | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    reasoning: dict | None = None
    truncation: str | None = None
    service_tier: str | None = None
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # state: refused unless absent (or false)
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict | None = None
    background: bool | None = None
    prompt: dict | None = None

    def check_supported(self) -> None:
        """400 naming the field for what needs stored state or is not implemented."""
        if self.store:
            raise bad_request(f"store=true is not supported: {STATELESS}; send store=false", param="store")
        for name in ("previous_response_id", "conversation", "background", "prompt"):
            if getattr(self, name):
                raise bad_request(f"{name} is not supported: {STATELESS}", param=name)
        refused = {
            "top_logprobs": (self.top_logprobs not in (None, 0), "logprobs are served on /v1/chat/completions"),
            "max_tool_calls": (self.max_tool_calls is not None,
                               "use parallel_tool_calls=false for at most one call per response"),
            "reasoning": (bool(self.reasoning) and any(v not in (None, "none") for v in self.reasoning.values()),
                          "the served model does not reason"),
            "truncation": (self.truncation not in (None, "disabled"),
                           "input over the context is refused, never cut (truncation=disabled)"),
            "service_tier": (self.service_tier not in (None, "auto", "default"), "there is one tier"),
            "text": (self.text is not None and self.text.verbosity not in (None, "medium"),
                     "the served model takes no verbosity hint"),
        }
        for name, (bad, why) in refused.items():
            if bad:
                raise bad_request(f"{name}={json.dumps(getattr(self, name), default=str)} is not supported: {why}",
                                  param=name)
        for value in self.include or []:
            if value not in _INCLUDE_NOTHING:
                raise bad_request(f"include={json.dumps(value)} is not supported (logprobs are served on "
                                  "/v1/chat/completions)", param="include")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise bad_request(f"max_output_tokens must be at least 1, got {self.max_output_tokens}",
                              param="max_output_tokens")
        count, key_len, value_len = MAX_METADATA
        meta = self.metadata or {}
        if len(meta) > count or any(len(k) > key_len or len(v) > value_len for k, v in meta.items()):
            raise bad_request(f"metadata takes at most {count} pairs, keys of at most {key_len} characters and "
                              f"values of at most {value_len}", param="metadata")

    # ---- translation

    def to_chat(self) -> ChatCompletionRequest:
        """The chat completion request this one is served as; 400 naming the Responses field."""
        self.check_supported()
        fields: dict[str, Any] = {
            "model": self.model, "messages": self._messages(), "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "seed": self.seed, "stop": self.stop, "stream": self.stream, "speculative": self.speculative,
            # the session key routing uses: the cache key says which requests share a prefix
            "user": self.user or self.prompt_cache_key,
            "response_format": self._response_format(), "tools": self._tools(), "tool_choice": self._tool_choice(),
            "parallel_tool_calls": self.parallel_tool_calls}
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as e:  # checked above; kept a 400 should a case slip through
            raise bad_request(f"input: {e.errors()[0]['msg']}", param="input") from None

    def _messages(self) -> list[dict]:
        out = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        if isinstance(self.input, str):
            return out + [{"role": "user", "content": self.input}]
        if not self.input:
            raise bad_request("input must not be empty", param="input")
        for i, item in enumerate(self.input):
            _item(out, item, f"input[{i}]")
        return out

    def _response_format(self) -> dict | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.get("type") in ("text", "json_object"):
            _keys(fmt or {}, {"type"}, "text.format")
            return fmt
        if fmt.get("type") != "json_schema":
            raise bad_request(f"text.format.type must be text, json_object or json_schema, got "
                              f"{json.dumps(fmt.get('type'))}", param="text")
        _keys(fmt, {"type", "name", "schema", "description", "strict"}, "text.format")
        if not isinstance(fmt.get("name"), str) or not _NAME.match(fmt["name"]):
            raise bad_request("text.format.name must be 1-64 letters, digits, _ or -", param="text")
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("text.format.schema must be a JSON schema (an object)", param="text")
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}

    def _tools(self) -> list[dict] | None:
        if not self.tools:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            if tool.get("type") != "function":
                raise bad_request(f"tools[{i}]: type {json.dumps(tool.get('type'))} is not supported; only function "
                                  "tools are (no hosted tools on this server)", param="tools")
            _keys(tool, {"type", "name", "description", "parameters", "strict"}, f"tools[{i}]", param="tools")
            name = tool.get("name")
            if not isinstance(name, str) or not _NAME.match(name):
                raise bad_request(f"tools[{i}].name must be 1-64 letters, digits, _ or -", param="tools")
            if not isinstance(tool.get("parameters", {}), (dict, type(None))):
                raise bad_request(f"tools[{i}].parameters must be a JSON schema (an object)", param="tools")
            if not isinstance(tool.get("description", ""), (str, type(None))) or not isinstance(
                    tool.get("strict", True), (bool, type(None))):
                raise bad_request(f"tools[{i}]: description must be a string and strict a boolean", param="tools")
            fn = {"name": name, "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
            if tool.get("description"):
                fn["description"] = tool["description"]
            out.append({"type": "function", "function": fn})
        return out

    def _tool_choice(self) -> str | dict | None:
        choice = self.tool_choice
        if choice is None or choice in ("none", "auto", "required"):
            return choice
        if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) == {"type", "name"}:
            return {"type": "function", "function": {"name": choice["name"]}}
        raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
                          param="tool_choice")

    def echo(self) -> dict:
        """The request's settings as the response object repeats them."""
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "max_tool_calls": None, "metadata": self.metadata or {},
                "parallel_tool_calls": self.parallel_tool_calls is not False, "previous_response_id": None,
                "reasoning": None, "store": False, "background": False, "service_tier": "default",
                "temperature": 1.0 if self.temperature is None else self.temperature,
                "top_p": 1.0 if self.top_p is None else self.top_p, "truncation": "disabled",
                "text": {"format": (self.text.format if self.text and self.text.format else {"type": "text"})},
                "tool_choice": self.tool_choice if self.tool_choice is not None else "auto",
                "tools": [{"type": "function", "description": None, "strict": True, **t} for t in self.tools or []],
                "user": self.user, "safety_identifier": self.safety_identifier,
                "prompt_cache_key": self.prompt_cache_key, "top_logprobs": self.top_logprobs}


@contextlib.contextmanager
def responses_names() -> Iterator[None]:
    """Errors from the chat pipeline name the Responses API's fields (max_output_tokens, not max_tokens)."""
    try:
        yield
    except APIError as e:
        new = _CHAT_NAMES.get(e.param or "")
        if new is not None:
            e.param = new.split(".")[0]
            e.message = _CHAT_WORDS.sub(lambda m: _CHAT_NAMES[m.group(1)], e.message)
        raise


# ---- input items


def _item(out: list[dict], item: dict, where: str) -> None:
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        _keys(item, {"type", "role", "content", "id", "status"}, where)
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise bad_request(f"{where}.role must be user, assistant, system or developer, got {json.dumps(role)}",
                              param="input")
        out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
    elif kind == "function_call":
        _keys(item, {"type", "call_id", "name", "arguments", "id", "status"}, where)
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise bad_request(f"{where}.{key} must be a string", param="input")
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        last = out[-1] if out else None
        if last is not None and last["role"] == "assistant":  # its text, then its calls: one chat message
            last.setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        _keys(item, {"type", "call_id", "output", "id", "status"}, where)
        if not isinstance(item.get("call_id"), str):
            raise bad_request(f"{where}.call_id must be a string", param="input")
        out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item.get("output"),
                                                                                      f"{where}.output")})
    else:
        raise bad_request(f"{where}: item type {json.dumps(kind)} is not supported; this server takes message, "
                          f"function_call and function_call_output items (it is stateless and serves text)",
                          param="input")


def _text(content, where: str) -> str:
    """A string, or text parts (input_text, and output_text/refusal from earlier output), joined as chat joins them."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text parts", param="input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        field = {"input_text": "text", "output_text": "text", "refusal": "refusal"}.get(kind)
        if field is None:
            raise bad_request(f"{where}[{j}]: part type {json.dumps(kind)} is not supported; only text "
                              "(input_text) is", param="input")
        _keys(part, {"type", field, "annotations", "logprobs"}, f"{where}[{j}]")
        if not isinstance(part.get(field), str):
            raise bad_request(f"{where}[{j}].{field} must be a string", param="input")
        texts.append(part[field])
    return "\n".join(texts)


def _keys(obj: dict, allowed: set[str], where: str, param: str | None = None) -> None:
    extra = sorted(set(obj) - allowed)
    if extra:
        raise bad_request(f"Unrecognized argument supplied in {where}: {extra[0]}",
                          param=param or where.split(".")[0].split("[")[0])
