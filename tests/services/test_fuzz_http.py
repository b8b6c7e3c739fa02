"""Generated hostile input over the HTTP API (issue 70, item 3): every answer is a 200 or an
OpenAI-shaped 4xx ({"error": {"message", "type", "param", "code"}}), never a 5xx, responses are
JSON (no NaN or Infinity), and the gateway and its verifier keep serving (alive, /health 200, a
plain request of every route answered, no traceback in either log).

A real gateway (with an API key) in front of a real verifier on the bundled demo target, with the
suffix index as its drafter. Bodies of /v1/chat/completions, /v1/completions, /v1/responses,
/tokenize and /detokenize come from their pydantic models' JSON schemas: a valid body (each
optional field in one body of three; realistic shapes for what a schema leaves open: tools,
response_format, structured_outputs, Responses input items), then 0-3 of its values, at any depth,
replaced by an extreme of their type (integers past every bound, NaN, infinities, huge strings and
arrays, lone surrogates), another type, any JSON, or the value nested up to 150 levels; unknown
keys added, known ones dropped. The lengths are 1-3 tokens in a valid body, so one that passes every
check costs milliseconds. test_bad_input.py keeps the hand-written list; besides the bodies:
- the same bodies as hostile JSON text: duplicate keys, invalid UTF-8 in strings, NaN, Infinity
  and 1e400 literals, deep nesting, a UTF-16 or BOM-prefixed body, truncation, trailing garbage;
- hostile headers: content types, authorization garbage, 300 KB values, control characters (which
  uvicorn's parser refuses with a plain-text 400 before the app sees the request: the one answer
  that is not OpenAI's shape, allowed only then).

The budget is fixed and the examples derandomized (tests/services/fuzzing.py); SPECD_FUZZ_EXAMPLES
or bench/fuzz.py runs the same properties longer.

What it found, each fixed and kept below as a plain test: a surrogate encoded in UTF-8 bytes
passed as a lone surrogate (json.loads(bytes) decodes with surrogatepass) and the 404 quoting it
was a 500; every GBNF grammar was a 500 (llguidance.gbnf_to_lark is a module, not the function);
logprobs of tokens a grammar rules out (-inf) were a 500, or -Infinity in a stream; and an error
quoting a huge value (a 100 KB drafter name) came back 429, the gRPC client having refused the
verifier's oversized status trailer as RESOURCE_EXHAUSTED. A longer run (1,500 examples a property)
found a message's tool call with "function": true (a TypeError where the template's messages are
made).

The properties can fail: test_the_properties_fail_when_an_error_path_is_broken starts a second
gateway with an error path broken on purpose and asserts the bodies property finds a 500 there.
With the handler that turns pydantic's errors into 400s made to raise, it fails at once on a
malformed /v1/completions body; with /detokenize's check of token ids against the vocabulary
removed, on a body with a negative token id (the tokenizer's OverflowError; shrunk, {"tokens": [-1]}).
"""
from __future__ import annotations

import codecs
import http.client
import json
import re
import time

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzzing import (EDGE_INTS, any_json, find_settings, floats, fuzz_settings, huge, huge_texts, ints, keys,
                     note, texts)
from specd.gateway.responses_request import ResponsesRequest
from specd.gateway.schemas import ChatCompletionRequest, CompletionRequest
from specd.gateway.tokenization import DetokenizeRequest, TokenizeRequest
from specd.models.demo_paths import demo_model_dir

MODEL_DIR = demo_model_dir("target")
MODEL = "specd-demo-target"
API_KEY = "fuzz-key"
AUTH = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
pytestmark = pytest.mark.skipif(not (MODEL_DIR / "config.json").is_file(), reason="the bundled demo target is missing")

ROUTES = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
          "/v1/responses": ResponsesRequest, "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}
# The fields that say how many tokens to generate: 1-3 in a valid body, so one that passes every
# check costs milliseconds; a mutation makes them anything (an absent one is put back: the default is
# the rest of the context).
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
VALID = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
         "/v1/completions": {"prompt": "def f", "max_tokens": 2},
         "/v1/responses": {"input": "hi", "max_output_tokens": 2},
         "/tokenize": {"prompt": "hi"}, "/detokenize": {"tokens": [5, 6]}}


# ---- bodies from the request schemas: a valid body of the schema, then 0-3 hostile mutations

def _schema_names() -> set[str]:
    names: set[str] = set()

    def walk(node) -> None:
        if isinstance(node, dict):
            names.update(node.get("properties", {}))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for model in ROUTES.values():
        walk(model.model_json_schema())
    return names


KNOWN = _schema_names()
unknown_keys = keys.filter(lambda k: k not in KNOWN)
# A lone UTF-16 surrogate: valid JSON (as a \\ud800 escape), not Unicode; hypothesis' text() never draws one.
lone_surrogates = st.tuples(texts, st.sampled_from(["\ud800", "\udfff", "\udbff"]), texts).map("".join)
token_ids = st.integers(0, 4095)  # the demo target's vocabulary
json_schemas = st.one_of(st.just({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
                         st.fixed_dictionaries({"type": st.sampled_from(["object", "string", "array", "integer", "x"])},
                                               optional={"properties": st.dictionaries(texts, any_json, max_size=3),
                                                         "enum": st.lists(any_json, max_size=3),
                                                         "pattern": texts, "maxLength": ints, "items": any_json}),
                         st.booleans())
functions = st.fixed_dictionaries({"name": st.one_of(st.sampled_from(["get_weather", "f"]), texts)},
                                  optional={"parameters": json_schemas, "description": texts})
text_parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), max_size=3)
# Valid values (or the real shapes of what a schema leaves open: dict, list[dict]) where the type
# alone says too little; mutations make them hostile.
GOOD = {
    "model": st.sampled_from([MODEL, MODEL, "gpt-4o"]),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "min_p": st.floats(0, 1),
    "top_k": st.integers(-1, 50), "seed": st.integers(0, 2 ** 63 - 1),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "logit_bias": st.dictionaries(token_ids.map(str), st.floats(-100, 100), max_size=3),
    "stop_token_ids": st.lists(token_ids, max_size=3),
    "stop": st.one_of(texts, st.lists(texts, max_size=3)),
    "n": st.integers(1, 3), "best_of": st.none(), "echo": st.just(False), "suffix": st.none(),
    **{name: st.integers(1, 3) for name in LENGTH_FIELDS},
    "min_tokens": st.integers(0, 1), "top_logprobs": st.integers(0, 3),
    "num_speculative_tokens": st.integers(0, 4), "drafter": st.sampled_from(["", "", "suffix", "nope"]),
    "role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
    "content": st.one_of(texts, text_parts),
    "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": functions}), max_size=2),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]),
                             st.fixed_dictionaries({"type": st.just("function"),
                                                    "function": st.fixed_dictionaries({"name": texts})})),
    "response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema"])},
        optional={"json_schema": st.fixed_dictionaries({"name": st.just("out")}, optional={"schema": json_schemas})}),
    "structured_outputs": st.dictionaries(st.sampled_from(["json", "json_object", "regex", "choice", "grammar"]),
                                          st.one_of(json_schemas, st.sampled_from(
                                              ["a+", "[0-9]{1,3}", "(a|b)*c", "\\", "a{99999}", "start: /x/",
                                               'root ::= "a"', "(", "[z-a]"]), st.lists(texts, max_size=3)),
                                          min_size=1, max_size=1),
    "text": st.fixed_dictionaries({}, optional={
        "format": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
                            st.fixed_dictionaries({"type": st.just("json_schema"), "name": st.just("out"),
                                                   "schema": json_schemas}))}),
    "input": st.one_of(texts, st.lists(st.one_of(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "developer"])},
                              optional={"type": st.just("message"), "content": st.one_of(texts, st.lists(
                                  st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text"]),
                                                         "text": texts}), max_size=3))}),
        st.fixed_dictionaries({"type": st.just("function_call"), "call_id": texts, "name": texts,
                               "arguments": texts}),
        st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": texts, "output": texts})),
        min_size=1, max_size=3)),
    "metadata": st.dictionaries(texts, texts, max_size=3),
    "include": st.lists(st.just("reasoning.encrypted_content"), max_size=1),
    "reasoning": st.dictionaries(st.sampled_from(["effort", "summary"]), st.sampled_from([None, "none"])),
    "truncation": st.sampled_from(["disabled", "auto"]), "service_tier": st.sampled_from(["auto", "default", "flex"]),
    "store": st.just(False), "background": st.just(False),
    "prompt": st.one_of(texts, st.lists(token_ids, min_size=1, max_size=6), st.lists(texts, min_size=1, max_size=1),
                        st.lists(st.lists(token_ids, min_size=1, max_size=4), min_size=1, max_size=1)),
    "tokens": st.lists(token_ids, max_size=8),
}
# Fields a valid body leaves out (state the server does not keep; a stored prompt)
NEVER = {"previous_response_id", "conversation"}


def _good(name: str | None, schema: dict, defs: dict) -> st.SearchStrategy:
    """A valid value for the field (by GOOD, else by its type)."""
    if name in GOOD:
        return GOOD[name]
    if "$ref" in schema:
        return _object(defs[schema["$ref"].rsplit("/", 1)[1]], defs)
    if "anyOf" in schema:
        options = [s for s in schema["anyOf"] if s.get("type") != "null"] or schema["anyOf"]
        return st.one_of([_good(name, s, defs) for s in options])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "array":
        return st.lists(_good(None, schema.get("items", {}), defs), min_size=name == "messages", max_size=3)
    if kind == "object" and "properties" in schema:
        return _object(schema, defs)
    return {"string": texts, "integer": st.integers(0, 3), "number": st.floats(0, 1), "boolean": st.booleans(),
            "null": st.none()}.get(kind, st.dictionaries(keys, any_json, max_size=3))


def _object(schema: dict, defs: dict) -> st.SearchStrategy:
    props = {k: v for k, v in schema.get("properties", {}).items() if k not in NEVER}
    required = set(schema.get("required", []))
    fields = {name: _good(name, sub, defs) for name, sub in props.items()}

    @st.composite
    def body(draw) -> dict:
        # each optional field in one body of three: with half of them set (fixed_dictionaries'
        # optional), a body of 30 fields nearly always held a combination that is refused
        # (tools on a model without them, top_logprobs without logprobs), and few went further
        out = {}
        for name, value in fields.items():
            if name in required or draw(st.integers(0, 2), label=name) == 2:  # shrinks to "left out"
                out[name] = draw(value, label=name)
        return out

    return body()


# Integers past a bound: below 0, past the vocabulary (4096), the context (1024), the wire types
outside = st.one_of(st.integers(-5, -1), st.integers(1025, 5000), st.sampled_from(EDGE_INTS), st.integers())


def _hostile_like(value) -> st.SearchStrategy:
    """What a value is replaced with: mostly an extreme of its own type (which gets past a type
    check to the bound behind it), else another type, any JSON, or the value nested deep."""
    if isinstance(value, bool):
        same = st.sampled_from([0, 1, "true", None])
    elif isinstance(value, int):
        same = st.one_of(outside, outside, ints, floats, st.integers(-5, 40).map(float), ints.map(str))
    elif isinstance(value, float):
        same = st.one_of(floats, floats, ints, floats.map(str))
    elif isinstance(value, str):
        same = st.one_of(huge_texts, texts, lone_surrogates, lone_surrogates, st.just("\x00" * 64))
    elif isinstance(value, list):  # huge (to about twice the gateway's 4 MB limit), or an element of another type
        most = max(2, min(5000, (8 << 20) // len(_dumps(value or [0]))))
        same = st.one_of(st.just([]), st.integers(2, most).map(lambda n: (value or [0]) * n),
                         any_json.map(lambda x: [*value, x]))
    elif isinstance(value, dict):  # an unknown key beside the known, or a known one dropped
        same = st.one_of(st.tuples(unknown_keys | lone_surrogates, any_json).map(lambda kv: {**value, kv[0]: kv[1]}),
                         *([st.sampled_from(sorted(value)).map(lambda k: {n: v for n, v in value.items() if n != k})]
                           if value else []))
    else:
        same = any_json
    nested = st.integers(1, 150).map(lambda depth: _nest(value, depth))
    return st.one_of(same, same, same, any_json, nested)


def _nest(value, depth: int):
    for _ in range(depth):
        value = [value]
    return value


def _paths(value, path=()):
    yield path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        yield from _paths(item, (*path, key))


def _replace(value, path: tuple, new):
    if not path:
        return new
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[path[0]] = _replace(value[path[0]], path[1:], new)
    return copy


def _get(value, path: tuple):
    for key in path:
        value = value[key]
    return value


@st.composite
def _mutated(draw, valid: st.SearchStrategy):
    body = draw(valid)
    for _ in range(draw(st.integers(0, 3))):  # 0: the valid body as it is
        paths = list(_paths(body))
        # the same weight to the body's own fields as to everything nested under them
        path = draw(st.sampled_from([p for p in paths if len(p) <= 1]) | st.sampled_from(paths), label="where")
        body = _replace(body, path, draw(_hostile_like(_get(body, path)), label="with"))
    return body


def _bounded(path: str, body):
    """A generation body that names no length gets one: never the default (the rest of the context)."""
    if isinstance(body, dict) and path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        if not any(body.get(name) is not None for name in LENGTH_FIELDS):
            body["max_output_tokens" if path == "/v1/responses" else "max_tokens"] = 2
    return body


def _coherent(path: str, body: dict) -> dict:
    """A valid body's fields agree: stream_options with stream, top_logprobs with logprobs, one of
    /tokenize's prompt and messages (the fields are drawn one by one; each rule broken is a 400,
    and would end most bodies there)."""
    if "stream_options" in body:
        body["stream"] = True
    if path == "/v1/chat/completions" and "top_logprobs" in body:
        body["logprobs"] = True
    if path == "/tokenize":
        for_messages = {"messages", "add_generation_prompt", "continue_final_message", "tools"} & set(body)
        if for_messages:
            body.pop("prompt", None)
            body.setdefault("messages", [{"role": "user", "content": "hi"}])
            body.pop("continue_final_message", None)
        else:
            body.setdefault("prompt", "hi")
    return body


def bodies(path: str) -> st.SearchStrategy:
    schema = ROUTES[path].model_json_schema()
    valid = _object(schema, schema.get("$defs", {})).map(lambda b: _bounded(path, _coherent(path, b)))
    return _mutated(valid).map(lambda b: _bounded(path, b))


routes = st.sampled_from(sorted(ROUTES))
routed_bodies = routes.flatmap(lambda p: st.tuples(st.just(p), bodies(p)))


# ---- the same bodies as hostile JSON text

BAD_UTF8 = [b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf", b"\x80", b"\xe2\x82",
            b"\xf8\x88\x80\x80\x80"]
NUMBERS = [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e400", b"1e-400", b"-0", b"0.0", b"1E2", b"2.5",
           b"18446744073709551616", b"-9223372036854775809"]


@st.composite
def json_text(draw, value) -> bytes:
    """value written as JSON, with hostile spellings drawn at each node."""
    def write(v, depth: int) -> bytes:
        tweak = draw(st.integers(0, 19))
        if tweak == 0 and depth < 6:  # nest the value 1-150 levels deeper
            levels = draw(st.integers(1, 150))
            return b"[" * levels + write(v, depth + 1) + b"]" * levels
        if isinstance(v, dict):
            items = list(v.items())
            if items and tweak == 1:  # a key twice: the parser keeps the last
                key = draw(st.sampled_from([k for k, _ in items]))
                items.insert(draw(st.integers(0, len(items))), (key, draw(any_json)))
            return b"{" + b",".join(string(str(k)) + b":" + write(x, depth + 1) for k, x in items) + b"}"
        if isinstance(v, list):
            return b"[" + b",".join(write(x, depth + 1) for x in v) + b"]"
        if isinstance(v, str):
            return string(v)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and tweak == 2:
            return draw(st.sampled_from(NUMBERS))
        return json.dumps(v).encode()

    def string(s: str) -> bytes:
        raw = json.dumps(s, ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")
        if draw(st.integers(0, 9)) == 0:  # invalid UTF-8 inside the quotes
            at = draw(st.integers(1, len(raw) - 1))
            raw = raw[:at] + draw(st.sampled_from(BAD_UTF8)) + raw[at:]
        return raw

    text = write(value, 0)
    whole = draw(st.integers(0, 29))
    if whole == 0:
        return codecs.BOM_UTF8 + text
    if whole == 1:  # json.loads detects UTF-16 and UTF-32 from the first bytes
        return text.decode("utf-8", "replace").encode(draw(st.sampled_from(["utf-16", "utf-16-le", "utf-32"])))
    if whole == 2:
        return text[:draw(st.integers(0, len(text)))]
    if whole == 3:
        return text + draw(st.sampled_from([b"x", b"}", b"\x00", b" {}", b"\n\n"]))
    return text


# ---- headers

CONTENT_TYPES = ["application/json", "APPLICATION/JSON", "application/json; charset=utf-8",
                 "application/json; charset=latin-1", "application/json;", " application/json ", "application/json,",
                 "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "", "*/*",
                 "application/json-patch+json", "application/json\x7f"]
# RFC 9110's field values (visible ASCII, space and tab inside, bytes 0x80-0xff), and now and then a
# control character, which the HTTP parser refuses before the app sees the request (CTL below).
header_texts = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xff, exclude_characters="\x7f"), max_size=40)
header_values = st.one_of(header_texts, huge(st.sampled_from(["a", "Bearer ", "\xe9", "x, y; "]), 60_000),
                          st.tuples(header_texts, st.sampled_from(["\x00", "\x01", "\x1b", "\x7f"]), header_texts).map(
                              "".join))
CTL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
authorizations = st.one_of(st.just(f"Bearer {API_KEY}"), st.just(f"bearer {API_KEY}"), st.just(f"Bearer {API_KEY} "),
                           st.just(API_KEY), st.just("Bearer"), header_values,
                           header_texts.map(lambda t: f"Bearer {t}"))
header_names = st.one_of(st.sampled_from(["x-session-id", "accept", "accept-encoding", "user-agent", "traceparent",
                                          "x-forwarded-for", "cookie", "origin", "openai-organization"]),
                         st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyz-0123456789"), min_size=1, max_size=20))
headers = st.fixed_dictionaries({}, optional={"content-type": st.one_of(st.sampled_from(CONTENT_TYPES), header_texts),
                                              "authorization": authorizations}).flatmap(
    lambda fixed: st.dictionaries(header_names.filter(lambda n: n not in ("content-type", "authorization")),
                                  header_values, max_size=3).map(lambda extra: {**extra, **fixed}))


# ---- the stack and the checks

@pytest.fixture(scope="module")
def stack(launcher):
    verifier = launcher.start("verifier", "verifier", ["--model", str(MODEL_DIR), "--dtype", "float32", "--device",
                                                       "cpu", "--local-drafter", "suffix", "--log-level", "warning"])
    gateway = launcher.start("gateway", "gateway", ["--verifier", verifier.address, "--api-key", API_KEY,
                                                    "--log-level", "warning"], http=True)
    with httpx.Client(base_url=f"http://{gateway.address}", timeout=60) as client:
        yield dict(verifier=verifier, gateway=gateway, client=client)


def strict_json(text):
    """JSON as RFC 8259 has it: NaN and Infinity, which Python writes by default, are not JSON."""
    def refuse(constant):
        raise AssertionError(f"{constant} in a response: not JSON")

    return json.loads(text, parse_constant=refuse)


RESET = 0  # Answer.status of a request whose connection the server closed before answering


class Answer:
    def __init__(self, status: int, content_type: str, content: bytes):
        self.status, self.content_type, self.content = status, content_type, content

    def json(self):
        return strict_json(self.content)


def check_answer(r: Answer, what, http_error: bool = False) -> None:
    """200, or a 4xx whose body is exactly OpenAI's error object. http_error: the request is not
    valid HTTP (a control character in a header); uvicorn's parser answers it, a plain-text 400."""
    what = repr(what)[:600]
    assert r.status < 500, f"{r.status} for {what}:\n{r.content[:500]!r}"
    if http_error:  # a 400, or the connection closed while a long request was still being sent
        assert r.status in (400, RESET), (r.status, r.content[:300])
        note("refused by the HTTP parser")
        return
    if r.status == 200:
        note(f"200 {r.content_type}")
        if r.content_type.startswith("text/event-stream"):
            events = [line[6:] for line in r.content.decode().split("\n") if line.startswith("data: ")]
            if events[-1] == "[DONE]":  # chat and completions; the Responses API ends with its last event
                events.pop()
            for data in map(strict_json, events):  # no error event, in either API's form
                assert "error" not in data and data.get("type") not in ("error", "response.failed"), (what, data)
            assert "type" not in data or data["type"] in ("response.completed", "response.incomplete"), data
        else:
            assert isinstance(r.json(), dict)
        return
    assert 400 <= r.status < 500
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), body
    assert err["param"] is None or isinstance(err["param"], str), body
    note(f"{r.status} {err['param']}: {err['message'][:40]}")


def post(stack, path: str, content: bytes, headers: dict = AUTH) -> Answer:
    r = stack["client"].post(path, content=content, headers=headers)
    return Answer(r.status_code, r.headers.get("content-type", ""), r.content)


def post_raw(stack, path: str, content: bytes, headers: dict[str, bytes]) -> Answer:
    """Through http.client, which sends header bytes that httpx (h11) refuses to: control characters."""
    host, port = stack["gateway"].address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.putrequest("POST", path, skip_accept_encoding=True)
        for name, value in headers.items():
            conn.putheader(name, value)
        conn.putheader("content-length", str(len(content)))
        conn.endheaders(content)
        r = conn.getresponse()
        return Answer(r.status, r.getheader("content-type", ""), r.read())
    except (ConnectionResetError, BrokenPipeError) as e:
        return Answer(RESET, "", repr(e).encode())
    finally:
        conn.close()


def healthy(client: httpx.Client, wait_s: float = 30.0) -> bool:
    """/health says 200 within wait_s (one probe can time out on a loaded machine: it is asked again)."""
    deadline = time.monotonic() + wait_s
    while client.get("/health").status_code != 200:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def still_serving(stack) -> None:
    """Both processes alive, a plain valid request of every route answered, no traceback logged."""
    for name in ("verifier", "gateway"):
        assert stack[name].proc.poll() is None, f"{name} died:\n{stack[name].log_text()[-3000:]}"
    for path, body in VALID.items():
        r = post(stack, path, json.dumps(body).encode())
        assert r.status == 200, (path, r.status, r.content[:500])
    assert healthy(stack["client"]), stack["client"].get("/health").text
    for name in ("verifier", "gateway"):
        assert "Traceback" not in stack[name].log_text(), f"{name}:\n{stack[name].log_text()[-3000:]}"


@pytest.fixture
def serving(stack):
    """The stack, checked again after the property ran."""
    yield stack
    still_serving(stack)


def _dumps(body, ensure_ascii: bool = False) -> bytes:
    """JSON as Python writes it (NaN and Infinity included); a lone surrogate as a \\ud800 escape
    (ensure_ascii) or as the three bytes that would encode it in UTF-8 (invalid UTF-8)."""
    return json.dumps(body, allow_nan=True, ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass")


# ---- properties (the fixture `serving` is per test, not per example: the stack is checked once the
# property has run; fuzz_settings suppresses hypothesis' health check that says so)

@pytest.mark.parametrize("path", sorted(ROUTES))
@fuzz_settings()
@given(data=st.data())
def test_generated_bodies(serving, path, data):
    body = data.draw(bodies(path), label="body")
    check_answer(post(serving, path, _dumps(body, data.draw(st.booleans(), label="ensure_ascii"))), body)


@fuzz_settings(share=1.5)
@given(routed=routed_bodies, data=st.data())
def test_generated_raw_json_text(serving, routed, data):
    path, body = routed
    raw = data.draw(json_text(body), label="raw")
    check_answer(post(serving, path, raw), raw[:300])


@fuzz_settings(share=0.7)
@given(path=routes, hdrs=headers, valid=st.booleans(), data=st.data())
def test_generated_headers(serving, path, hdrs, valid, data):
    body = VALID[path] if valid else data.draw(bodies(path), label="body")
    raw = {name: value.encode("latin-1") for name, value in hdrs.items()}  # bytes > 0x7f as they are
    framing = any(CTL.search(value) for value in raw.values())
    check_answer(post_raw(serving, path, _dumps(body), raw), hdrs, http_error=framing)


# ---- what the fuzz found, kept as plain cases (each was a 500, or a 429 for a bad request)

def test_surrogates_encoded_in_utf8_bytes_are_a_400(serving):
    """json.loads(bytes) decodes with errors="surrogatepass": bytes ED A0 80 (a surrogate encoded in
    UTF-8, which is not valid UTF-8) became a lone surrogate the check for \\ud800 escapes missed, and
    echoing it in the 404 for an unknown model was a UnicodeEncodeError: a 500."""
    for path, raw in [("/detokenize", b'{"tokens": [], "model": "\xed\xa0\x80"}'),
                      ("/v1/completions", b'{"prompt": "a\xed\xbf\xbfb", "max_tokens": 2}')]:
        r = post(serving, path, raw)
        assert r.status == 400 and "not valid JSON" in r.json()["error"]["message"], (r.status, r.content)


def test_a_gbnf_grammar_is_served(serving):
    """structured_outputs.grammar in llama.cpp's GBNF was a 500 (TypeError: llguidance.gbnf_to_lark is a
    module); a GBNF grammar is served, a malformed one is a 400 naming the field."""
    body = {"prompt": "x", "max_tokens": 3, "structured_outputs": {"grammar": 'root ::= "yes" | "no"'}}
    r = post(serving, "/v1/completions", _dumps(body))
    assert r.status == 200 and r.json()["choices"][0]["text"] in ("yes", "no"), r.content
    body["structured_outputs"]["grammar"] = "root ::= ("
    r = post(serving, "/v1/completions", _dumps(body))
    assert r.status == 400 and r.json()["error"]["param"] == "structured_outputs", r.content


def test_an_error_quoting_a_huge_value_is_still_a_400(serving):
    """The verifier's error quoted a 100 KB drafter name in its status details; a gRPC client refuses a
    trailer that big and reported RESOURCE_EXHAUSTED instead, which the gateway answered 429, retry later."""
    body = {"prompt": "x", "max_tokens": 2, "speculative": {"drafter": "d" * 100_000}}
    r = post(serving, "/v1/completions", _dumps(body))
    assert r.status == 400 and "unknown drafter" in r.json()["error"]["message"], (r.status, r.content[:300])
    assert len(r.content) < 4096



def test_logprobs_a_grammar_rules_out_are_json(serving):
    """Under a grammar the alternatives it rules out have logprob -inf: a whole response was a 500
    (Starlette's JSON encoder refuses infinities) and a streamed one sent -Infinity, not JSON. They
    are -9999.0, vLLM's floor."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    floors = 0
    for stream in (False, True):
        for path, body in [("/v1/completions", {"prompt": "", "logprobs": 2, "structured_outputs": {"json": schema}}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                                     "top_logprobs": 3, "response_format": {"type": "json_object"}})]:
            body = {**body, "max_tokens": 2, "stream": stream}
            r = post(serving, path, _dumps(body))
            assert r.status == 200, (r.status, r.content[:300])
            check_answer(r, body)
            floors += r.content.count(b"-9999.0")
    assert floors

def test_a_tool_call_whose_function_is_no_object_is_a_400(serving):
    """Found by a longer run (bench/fuzz.py, 1,500 examples): a message's tool call with "function": true
    was a TypeError where the template's messages are made (dict(True)), a 500 on /tokenize and chat."""
    messages = [{"role": "system"}, {"role": "system", "tool_calls": [{"function": True}]}]
    for path, body in [("/tokenize", {"messages": messages}), ("/v1/chat/completions", {"messages": messages,
                                                                                       "max_tokens": 2})]:
        r = post(serving, path, _dumps(body))
        assert r.status == 400 and r.json()["error"]["param"] == "messages", (r.status, r.content[:300])

# ---- the properties can fail: a gateway with an error path broken on purpose

BREAKS = {  # what is broken, and the route whose bodies are fuzzed
    # the handler that turns pydantic's errors into 400s made to raise: a malformed body is a 500
    "validation": ("import specd.gateway.schemas as m\nm._validation_error = lambda err, data: 1 / 0\n",
                   "/v1/completions"),
    # /detokenize's check of the ids against the vocabulary removed: the tokenizer overflows on an id
    # past 2**32 or below 0
    "token ids": ("import specd.gateway.tokenization as m\n"
                  "m.DetokenizeRequest.work = lambda self, tokenizer, model: "
                  "lambda: {'prompt': tokenizer.decode(self.tokens, skip_special_tokens=False)}\n", "/detokenize"),
}


@pytest.mark.parametrize("name", sorted(BREAKS))
def test_the_properties_fail_when_an_error_path_is_broken(stack, launcher, tmp_path, monkeypatch, name):
    """A second gateway, its error path broken at startup (a sitecustomize module on its PYTHONPATH),
    in front of the same verifier: the bodies property finds a 500 and fails."""
    code, path = BREAKS[name]
    (tmp_path / "sitecustomize.py").write_text(code)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    broken = launcher.start(f"broken-{name}", "gateway", ["--verifier", stack["verifier"].address, "--api-key",
                                                          API_KEY, "--log-level", "warning"], http=True)
    monkeypatch.delenv("PYTHONPATH")
    with httpx.Client(base_url=f"http://{broken.address}", timeout=60) as client:
        @find_settings()
        @given(body=bodies(path), ensure_ascii=st.booleans())
        def prop(body, ensure_ascii):
            check_answer(post(dict(client=client), path, _dumps(body, ensure_ascii)), body)

        with pytest.raises(AssertionError, match="500 for") as failure:
            prop()
    print(f"{name}: {str(failure.value).splitlines()[0]}")
    launcher.stop(broken)
