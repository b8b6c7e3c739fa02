"""/v1/responses, /tokenize and /detokenize against test_gateway_api's scripted verifier (real gRPC,
in this process): the Responses body as the chat request it is served as, the response object and
its events as the official client's models define them, every refused or malformed field a 400
naming it. The real stacks (SmolLM2, a Qwen2.5 tool template) are in test_responses_e2e.py.
"""
from __future__ import annotations

import asyncio
import json

import openai
import pytest
from openai.types.responses import Response

from services.gateway import tools
from services.gateway.generation import Step
from services.gateway.responses_output import ResponsesFormatter
from services.gateway.app import build_app
from services.gateway.config import GatewayConfig, ModelInfo
from specd.models.demo_paths import demo_model_dir
from starlette.testclient import TestClient
from test_gateway_api import MODEL, REPLY, assert_error, fake, tok  # noqa: F401

RESPONSES = "/v1/responses"
MAX_MODEL_LEN = 1024  # room for a conversation of input items in the demo target's small vocabulary
# event types of a text answer, in order (the deltas repeat)
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def client(tok, fake):  # noqa: F811
    model = ModelInfo(name=MODEL, path=str(demo_model_dir("target")), max_model_len=MAX_MODEL_LEN,
                      vocab_size=tok.vocab_size)
    with TestClient(build_app(GatewayConfig(verifier=fake.address), model, tok)) as c:
        yield c


@pytest.fixture(scope="module")
def oai(client):
    """The official client, over the app (its transport is the test client)."""
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client, max_retries=0)


def _events(response) -> list[dict]:
    assert response.headers["content-type"].startswith("text/event-stream")
    out = []
    for block in response.text.split("\n\n")[:-1]:
        event, data = block.split("\n")
        out.append(json.loads(data.removeprefix("data: ")))
        assert event == f"event: {out[-1]['type']}"
    return out


def _kinds(events: list[dict]) -> list[str]:
    kinds = [e["type"] for e in events]
    return [k for i, k in enumerate(kinds) if k != "response.output_text.delta" or kinds[i - 1] != k]


def test_a_response_whole_and_streamed_as_the_client_parses_it(client, oai):
    whole = client.post(RESPONSES, json={"model": MODEL, "input": "Hi", "max_output_tokens": 40})
    assert whole.status_code == 200, whole.text
    parsed = Response.model_validate(whole.json())  # every field the official model requires, validated
    assert parsed.id.startswith("resp_") and parsed.object == "response" and parsed.status == "completed"
    assert parsed.output_text == REPLY and parsed.incomplete_details is None
    assert parsed.usage.total_tokens == parsed.usage.input_tokens + parsed.usage.output_tokens
    assert whole.json()["usage"]["speculative"]["drafts"] > 0  # specd's extension, as chat's usage
    events = _events(client.post(RESPONSES, json={"input": "Hi", "max_output_tokens": 40, "stream": True}))
    assert _kinds(events) == TEXT_EVENTS + ["response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    final = Response.model_validate(events[-1]["response"])
    assert text == final.output_text == events[-4]["text"] == REPLY
    assert events[0]["response"]["status"] == "in_progress" and final.usage.output_tokens == parsed.usage.output_tokens
    # the official client: whole, and its typed stream
    assert oai.responses.create(model=MODEL, input="Hi", max_output_tokens=40).output_text == REPLY
    streamed = list(oai.responses.create(model=MODEL, input="Hi", max_output_tokens=40, stream=True))
    assert streamed[-1].type == "response.completed" and streamed[-1].response.output_text == REPLY


def test_cut_by_max_output_tokens_is_incomplete(client):
    r = Response.model_validate(client.post(RESPONSES, json={"input": "Hi", "max_output_tokens": 3}).json())
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 3
    events = _events(client.post(RESPONSES, json={"input": "Hi", "max_output_tokens": 3, "stream": True}))
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["status"] == "incomplete"


def test_input_items_are_the_chat_messages_they_stand_for(client, fake):
    """The prompt a Responses body gets is the prompt of the chat request it translates to."""
    call = {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 2, "b": 3}'}
    responses_input = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me add.", "annotations": [], "logprobs": []}]},
        call, {**call, "call_id": "call_2"},
        {"type": "function_call_output", "call_id": "call_1", "output": "5"},
        {"role": "user", "content": [{"type": "input_text", "text": "And"}, {"type": "input_text", "text": "then?"}]}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "Let me add.", "tool_calls": [
            {"id": c, "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
            for c in ("call_1", "call_2")]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
        {"role": "user", "content": "And\nthen?"}]
    body = {"instructions": "Be brief.", "input": responses_input, "max_output_tokens": 2, "temperature": 0.5,
            "top_p": 0.9, "speculative": {"num_speculative_tokens": 3}, "seed": 7}
    r = client.post(RESPONSES, json=body).json()
    c = client.post("/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 2, "temperature": 0.5,
                                                  "top_p": 0.9, "speculative": {"num_speculative_tokens": 3},
                                                  "seed": 7}).json()
    got, want = fake.requests[r["id"]], fake.requests[c["id"]]
    assert list(got.prompt_token_ids) == list(want.prompt_token_ids)
    assert got.params == want.params
    # as the chat request: the same prompt size (the same template input)
    assert r["usage"]["input_tokens"] == c["usage"]["prompt_tokens"]
    assert r["temperature"] == 0.5 and r["top_p"] == 0.9 and r["instructions"] == "Be brief."


def test_text_format_is_the_chat_response_format(client, fake):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for fmt, response_format in [
            ({"type": "json_schema", "name": "x", "schema": schema, "strict": True},
             {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}),
            ({"type": "json_object"}, {"type": "json_object"})]:
        r = client.post(RESPONSES, json={"input": "Hi", "max_output_tokens": 2, "text": {"format": fmt}}).json()
        c = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                      "max_tokens": 2, "response_format": response_format}).json()
        assert fake.requests[r["id"]].params == fake.requests[c["id"]].params
        assert r["text"] == {"format": fmt}


def test_function_calls_come_back_as_items_whole_and_streamed():
    """Hermes-style calls read from the text: whole, they follow the message; streamed, the same items."""
    fmt = tools.ToolFormat("hermes", "<tool_call>", "</tool_call>", "arguments", True, {})
    text = ('Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>')
    pieces = [text[i:i + 7] for i in range(0, len(text), 7)]
    steps = [Step(text=p, token_ids=[1], logprobs=None, top_logprobs=None, text_offsets=[0],
                  finish_reason="stop" if i == len(pieces) - 1 else None, prompt_tokens=5, completion_tokens=i + 1,
                  spec=None) for i, p in enumerate(pieces)]
    formatter = ResponsesFormatter(request_id="resp_1", model=MODEL, echo={"tools": [], "tool_choice": "auto",
                                                                          "parallel_tool_calls": True},
                                   tool_names={"add"}, tool_format=fmt)
    whole = Response.model_validate(formatter.response(steps))
    assert [o.type for o in whole.output] == ["message", "function_call", "function_call"]
    assert whole.output_text == "Sure." and [json.loads(o.arguments) for o in whole.output[1:]] == [
        {"a": 1, "b": 2}, {"a": 3, "b": 4}]
    assert all(o.call_id.startswith("call_") and o.id.startswith("fc_") for o in whole.output[1:])

    async def run():
        async def rest():
            for s in steps[1:]:
                yield s
        return [e async for e in formatter.events(steps[0], rest())]

    events = [json.loads(b.decode().split("data: ", 1)[1]) for b in asyncio.run(run())]
    kinds = _kinds(events)
    call_events = ["response.output_item.added", "response.function_call_arguments.delta",
                   "response.function_call_arguments.done", "response.output_item.done"]
    assert kinds == TEXT_EVENTS + call_events * 2 + ["response.completed"]
    final = Response.model_validate(events[-1]["response"])
    assert [(o.type, getattr(o, "arguments", None)) for o in final.output] == [
        (o.type, getattr(o, "arguments", None)) for o in whole.output]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2]


BAD = [
    ({"input": "x", "store": True}, "store", "stateless"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "stateless"),
    ({"input": "x", "conversation": "conv_1"}, "conversation", "stateless"),
    ({"input": "x", "background": True}, "background", "stateless"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt", "stateless"),
    ({"input": "x", "top_logprobs": 3}, "top_logprobs", "chat/completions"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include", "not supported"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning", "does not reason"),
    ({"input": "x", "truncation": "auto"}, "truncation", "never cut"),
    ({"input": "x", "max_tool_calls": 2}, "max_tool_calls", "parallel_tool_calls"),
    ({"input": "x", "service_tier": "priority"}, "service_tier", "one tier"),
    ({"input": "x", "text": {"verbosity": "low"}}, "text", "verbosity"),
    ({"input": "x", "stream_options": {"include_obfuscation": False}}, "stream_options", "stream is true"),
    ({"input": "x", "metadata": {"k" * 65: "v"}}, "metadata", "64"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "at least 1"),
    ({"input": "x", "max_output_tokens": MAX_MODEL_LEN}, "max_output_tokens", "reduce max_output_tokens"),
    ({"input": "x", "temperature": -1}, "temperature", ""),
    ({"input": "x", "top_p": "1"}, "top_p", ""),
    ({"input": "x", "model": "gpt-4o"}, "model", "does not exist"),
    ({}, "input", "missing"),
    ({"input": "x", "frequency_penalty": 1}, "frequency_penalty", "unrecognized"),
    ({"input": 5}, "input", ""),
    ({"input": []}, "input", "must not be empty"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input", "not supported"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "stateless"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input", "role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "only text"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "input", "string"),
    ({"input": [{"role": "user", "content": "x", "colour": "red"}]}, "input", "colour"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input", "arguments"),
    ({"input": [{"type": "function_call_output", "output": "5"}]}, "input", "call_id"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text", "json_schema"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text", "name"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": []}}}, "text", "schema"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}},
     "text", "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_object", "schema": {}}}}, "text", "schema"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "only function tools"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name"}]}, "tools", "letters"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": []}]}, "tools", "JSON schema"),
    ({"input": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "function"),
    # the demo target's template takes no tools
    ({"input": "x", "tools": [{"type": "function", "name": "f"}]}, "tools", "does not take tools"),
    ({"input": "x", "tool_choice": "sometimes"}, "tool_choice", "required"),
    ({"input": "x", "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "name"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "f"}}, "tool_choice", "requires tools"),
]


@pytest.mark.parametrize("body,param,contains", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_responses_fields_are_400s_naming_them(client, body, param, contains):
    status = 404 if param == "model" else 400
    assert_error(client.post(RESPONSES, json=body), status, param=param, contains=contains)


def test_store_false_and_neutral_values_are_fine(client):
    body = {"input": "x", "max_output_tokens": 2, "store": False, "include": ["reasoning.encrypted_content"],
            "reasoning": {"effort": None}, "truncation": "disabled", "service_tier": "auto", "top_logprobs": 0,
            "metadata": {"k": "v"}, "user": "u", "safety_identifier": "s", "prompt_cache_key": "p",
            "text": {"format": {"type": "text"}, "verbosity": "medium"}, "tool_choice": "none"}
    r = client.post(RESPONSES, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["metadata"] == {"k": "v"} and r.json()["store"] is False


# ---- /tokenize, /detokenize


def test_tokenize_and_detokenize(client, tok, fake):  # noqa: F811
    prompt = "Hello wörld 世界"
    r = client.post("/tokenize", json={"prompt": prompt, "add_special_tokens": False, "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode(prompt, add_special_tokens=False) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_MODEL_LEN and len(r["token_strs"]) == r["count"]
    assert client.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": prompt}
    assert client.post("/v1/tokenize", json={"prompt": prompt}).json()["tokens"] == tok.encode(prompt)
    assert client.post("/tokenize", json={"prompt": prompt}).json()["token_strs"] is None
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    counted = client.post("/tokenize", json={"messages": messages}).json()
    c = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2}).json()
    assert counted["tokens"] == list(fake.requests[c["id"]].prompt_token_ids)
    assert counted["count"] == c["usage"]["prompt_tokens"]
    no_prompt = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert no_prompt["count"] < counted["count"] and counted["tokens"][:no_prompt["count"]] == no_prompt["tokens"]


TOKENIZE_BAD = [
    ("/tokenize", {}, "prompt", "either prompt or messages"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "messages", "not both"),
    ("/tokenize", {"prompt": 5}, "prompt", ""),
    ("/tokenize", {"prompt": "x", "tools": []}, "tools", "messages"),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt", "messages"),
    ("/tokenize", {"prompt": "x" * 1_000_000}, "prompt", "far longer"),  # refused before tokenizing
    ("/tokenize", {"messages": []}, "messages", "must not be empty"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages", ""),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
     "continue_final_message", "not supported"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {
        "name": "f"}}]}, "tools", "does not take tools"),
    ("/tokenize", {"prompt": "x", "model": "other"}, "model", "does not exist"),
    ("/tokenize", {"prompt": "x", "chat_template": "{{ x }}"}, "chat_template", "unrecognized"),
    ("/detokenize", {"tokens": [1, 4096]}, "tokens", "[0, 4096)"),  # the demo vocabulary's size
    ("/detokenize", {"tokens": [-1]}, "tokens", "[0, 4096)"),
    ("/detokenize", {"tokens": [2 ** 70]}, "tokens", ""),
    ("/detokenize", {"tokens": ["1"]}, "tokens", ""),
    ("/detokenize", {"tokens": [True]}, "tokens", ""),
    ("/detokenize", {"tokens": [1] * (4 * MAX_MODEL_LEN + 1)}, "tokens", "4 x max_model_len"),
    ("/detokenize", {}, "tokens", "missing"),
    ("/v1/detokenize", {"tokens": 5}, "tokens", ""),
]


@pytest.mark.parametrize("path,body,param,contains", TOKENIZE_BAD,
                         ids=[f"{b[0]}-{i}" for i, b in enumerate(TOKENIZE_BAD)])
def test_bad_tokenize_bodies_are_400s_naming_the_field(client, path, body, param, contains):
    status = 404 if param == "model" else 400
    assert_error(client.post(path, json=body), status, param=param, contains=contains)
