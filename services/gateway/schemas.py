"""OpenAI request bodies (pydantic v2) and their translation to SamplingParams.

Unknown fields are rejected (extra="forbid") and types are strict ("0.5" is not a
number), so a typo never silently changes what is generated. OpenAI fields that
would change the output but that specd does not implement are accepted only at
their neutral value (n=1, echo=false, ...), and rejected otherwise by name.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator
from starlette.requests import Request

from specd.sampling import SamplingParams
from specd.structured import StructuredOutput
from specd.structured import check as check_structured

from . import tools
from .errors import APIError, bad_request

# OpenAI's limits: chat's top_logprobs goes to 20, the legacy completions' logprobs to 5.
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool | None = False


class Speculative(_Body):
    """specd extension: per-request speculation (0 drafts = off), drafter choice, and whether the
    answer may join the suffix index's cache of finished answers that later requests draft from."""

    num_speculative_tokens: int | None = None
    drafter: str = ""
    cache_output: bool = True


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result: the call it answers

    @field_validator("tool_calls")
    @classmethod
    def _calls_name_functions(cls, calls: list[dict] | None) -> list[dict] | None:
        # the template reads each call's function as an object (tools.template_messages)
        if any(not isinstance(c.get("function", {}), dict) for c in calls or []):
            raise ValueError('each tool call\'s "function" must be an object: {"name": ..., "arguments": ...}')
        return calls

    def to_template(self) -> dict:
        content = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content or [])
        msg = {"role": self.role, "content": content}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                msg[key] = getattr(self, key)
        return msg


# field -> (is the value neutral?, what is supported): see the module docstring.
_NEUTRAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    "echo": (lambda v: not v, "echo=false"),
    "suffix": (lambda v: not v, "no suffix"),
}


class GenerationFields(_Body):
    """What every generation endpoint takes (chat, completions, responses), one definition of each
    field's type: the model, streaming, the user, specd's speculative and the sampling knobs (top_k
    and min_p are vLLM's extensions)."""
    model: str | None = None  # None: the served model (as vLLM)
    stream: bool | None = False
    user: str | None = None
    speculative: Speculative | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None


class _GenerationBody(GenerationFields):
    max_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float | None = None  # vLLM's extension, as min_tokens
    min_tokens: int | None = None
    # Structured output: OpenAI's response_format, or vLLM's structured_outputs (one of json,
    # json_object, regex, choice, grammar), not both.
    response_format: dict | None = None
    structured_outputs: dict | None = None

    def check_supported(self) -> None:
        for name, (neutral, supported) in _NEUTRAL.items():
            value = getattr(self, name, None)
            if name in type(self).model_fields and not neutral(value):
                raise bad_request(f"{name}={json.dumps(value)} is not supported; specd supports {supported}",
                                  param=name)
        best_of = getattr(self, "best_of", None)
        if best_of is not None and best_of != (self.n or 1):
            raise bad_request(f"best_of={best_of} is not supported; specd supports best_of equal to n ({self.n or 1}): "
                              "it returns every choice it generates", param="best_of")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def _logprobs(self) -> int | None:
        """None: no logprobs; n >= 0: each chosen token's logprob and the n most likely alternatives."""
        raise NotImplementedError

    def structured(self, tool_format=None) -> StructuredOutput | None:
        """What the output must match, checked (the grammar compiles); APIError 400 naming the field.
        tool_format: the model's (tools.tool_format), for a chat request that forces a tool call."""
        param = "structured_outputs" if self.structured_outputs is not None else "response_format"
        try:
            s = self._structured(tool_format)
            if s is not None:
                check_structured(s)
            return s
        except ValueError as e:
            raise bad_request(f"{param}: {e}", param=param) from None

    def _structured(self, tool_format=None) -> StructuredOutput | None:
        if self.response_format is not None and self.structured_outputs is not None:
            raise ValueError("set response_format or structured_outputs, not both")
        if self.structured_outputs is not None:
            return StructuredOutput.from_dict(self.structured_outputs)
        return StructuredOutput.from_response_format(self.response_format)

    def sampling_params(self, max_tokens: int, tool_format=None) -> SamplingParams:
        """Raises APIError 400 naming the field, with SamplingParams' own message."""
        spec = self.speculative
        structured = self.structured(tool_format)
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, min_p=self.min_p or 0.0,
                seed=self.seed, stop_token_ids=self.stop_token_ids or [], stop=self.stop_strings,
                ignore_eos=bool(self.ignore_eos),
                logprobs=self._logprobs(),
                num_speculative_tokens=spec.num_speculative_tokens if spec else None,
                structured_outputs=structured, cache_output=spec.cache_output if spec else True,
                presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                logit_bias=self.logit_bias or {}, min_tokens=self.min_tokens or 0,
                n=1 if self.n is None else self.n)
        except ValueError as e:
            msg = str(e)
            raise bad_request(msg, param=msg.split(" ", 1)[0]) from None


class ToolFields(_Body):
    """The tool fields of chat and responses requests (checked by tools.check)."""
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None


class ChatCompletionRequest(_GenerationBody, ToolFields):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None

    def check_tools(self, template: str | None, tool_format: tools.ToolFormat | None) -> None:
        """400 naming tools or tool_choice for what this model's template or specd cannot serve."""
        try:
            tools.check(self.tools, self.tool_choice, tool_format, template)
        except ValueError as e:
            param, _, message = str(e).partition(": ")
            raise bad_request(message, param=param) from None

    @property
    def tool_names(self) -> set[str] | None:
        """The declared functions whose calls are read back from the output; None: no tools in play."""
        if not self.tools or self.tool_choice == "none":
            return None
        return {t["function"]["name"] for t in self.tools}

    def _structured(self, tool_format=None) -> StructuredOutput | None:
        s = super()._structured()
        calls = tools.forced(self.tools, self.tool_choice, self.parallel_tool_calls is not False, tool_format)
        if calls is not None and s is not None:
            raise ValueError("a tool_choice that forces a call cannot be combined with a response format")
        return calls or s

    @property
    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens replaced max_tokens in OpenAI's chat API; it wins when both are set.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is None:
            return
        if not 0 <= self.top_logprobs <= MAX_CHAT_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs must be between 0 and {MAX_CHAT_TOP_LOGPROBS}, got {self.top_logprobs}",
                              param="top_logprobs")
        if not self.logprobs:  # as OpenAI and vLLM: alternatives only come with the chosen tokens' logprobs
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")

    def _logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_GenerationBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    best_of: int | None = None
    echo: bool | None = False
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise bad_request(f"logprobs must be between 0 and {MAX_COMPLETION_LOGPROBS}, got {self.logprobs}",
                              param="logprobs")

    def _logprobs(self) -> int | None:
        return self.logprobs


class RegisterDrafterBody(_Body):
    name: str
    address: str


async def read_json(request: Request, model: type[BaseModel], limit: int) -> Any:
    """The body parsed as `model`; 413 as soon as it is known to exceed `limit` bytes (declared or streamed)."""
    # Only JSON bodies: a browser sends text/plain or a form cross-site without asking (CSRF),
    # but application/json only after a CORS preflight this server never grants.
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise APIError(415, f"Content-Type must be application/json, got {media_type or 'none'}")
    too_large = APIError(413, f"request body exceeds the limit of {limit} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return parse_body(model, b"".join(chunks))


# Deeper than any OpenAI body needs (a tool's JSON schema nests a few levels); deeper input
# would reach recursion limits in the JSON encoder, pydantic or the chat template.
MAX_JSON_DEPTH = 64


def parse_body(model: type[BaseModel], raw: bytes) -> Any:
    """Malformed JSON and every validation failure are a 400 naming the first bad field."""
    try:
        # Decoded strictly, not as json.loads(bytes) decodes (errors="surrogatepass", which passes
        # surrogates encoded in UTF-8 bytes, invalid UTF-8, on as lone surrogates).
        text = raw.decode(json.detect_encoding(raw))
        data = json.loads(text)
    except RecursionError:
        raise bad_request(f"request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:  # JSONDecodeError, invalid UTF-8, an integer of over 4300 digits
        raise bad_request(f"request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    # Strictly decoded text holds no lone UTF-16 surrogate: one can only come from a \uD8xx-\uDFxx
    # escape, so look for one only then.
    _check_structure(data, surrogates="\\ud" in text.lower())
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e, data) from None


def _check_structure(data: dict, surrogates: bool) -> None:
    """400 for nesting deeper than MAX_JSON_DEPTH and, when asked, for strings holding a lone
    surrogate (valid JSON, but not Unicode: no tokenizer or encoder can take it)."""
    stack: list[tuple[Any, tuple, int]] = [(data, (), 1)]
    while stack:
        value, loc, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise bad_request(f"request body nests deeper than {MAX_JSON_DEPTH} levels", param=_param(loc))
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(item, (dict, list)):
                stack.append((item, (*loc, key), depth + 1))
            elif surrogates and isinstance(item, str) and not _is_unicode(item):
                raise bad_request(f"Invalid value for '{_dotted((*loc, key))}': the string holds a lone UTF-16 "
                                  "surrogate (\\ud800-\\udfff), which is not valid Unicode", param=_param((*loc, key)))
        if surrogates and isinstance(value, dict) and not all(_is_unicode(k) for k in value):
            raise bad_request("a key of the request body holds a lone UTF-16 surrogate, which is not valid Unicode",
                              param=_param(loc))


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _param(loc: tuple) -> str | None:
    return str(loc[0]) if loc else None


def _validation_error(err: ValidationError, data: dict) -> APIError:
    errors = err.errors()
    first = errors[0]
    loc = first["loc"]
    field = str(loc[0]) if loc else None
    if first["type"] == "extra_forbidden" and len(loc) == 1:
        return bad_request(f"Unrecognized request argument supplied: {field}", param=field)
    if first["type"] == "missing":
        return bad_request(f"Missing required parameter: '{_dotted(loc)}'", param=field)
    prefix = _common_prefix([e["loc"] for e in errors])
    if len(errors) > 1 and prefix:
        # A union (prompt, stop, content...) fails once per member; name the value, not each member.
        value = _walk(data, prefix)
        return bad_request(f"Invalid type for '{_dotted(prefix)}': {type(value).__name__} "
                           f"{json.dumps(value)[:80]} does not match any accepted form", param=field)
    return bad_request(f"Invalid value for '{_dotted(loc)}': {first['msg']}", param=field)


def _dotted(loc) -> str:
    return ".".join(map(str, loc))


def _common_prefix(locs: list[tuple]) -> tuple:
    prefix = locs[0]
    for loc in locs[1:]:
        n = 0
        while n < min(len(prefix), len(loc)) and prefix[n] == loc[n]:
            n += 1
        prefix = prefix[:n]
    return prefix


def _walk(data: Any, loc: tuple) -> Any:
    for key in loc:
        try:
            data = data[key]
        except (KeyError, IndexError, TypeError):  # a union member's tag, not a key of the body
            break
    return data
