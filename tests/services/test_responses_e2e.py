"""/v1/responses, /tokenize and /detokenize over real HTTP with the official client (issue 69).

Two stacks of real processes on loopback:
- the default target (SmolLM2-135M-Instruct: a verifier with the suffix index inside it, and a
  gateway): text whole and streamed (the events in order, the deltas joining to the final text, the
  same text and prompt as the chat request it stands for), a JSON schema in the Responses API's
  spelling, tools refused (its template takes none), stored state refused; /tokenize counts what
  chat reports as prompt_tokens and /detokenize undoes it.
- a random-weight GGUF with Qwen2.5's real tokenizer and tool template (tests/real_vocabs.py)
  through `specd up --target`: a forced function tool comes back as a function_call item whose
  arguments validate, the same whole, streamed and with speculation off; the call and its result
  go back as input items, as the chat turn they translate to.
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types.responses import Response

from specd.models import model_store

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.timeout(900)

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]},
                                            "high": {"type": "integer", "minimum": -50, "maximum": 50}},
           "required": ["city", "unit", "high"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                        "b": {"type": "integer", "minimum": -99, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER},
         {"type": "function", "name": "add", "description": "Add two integers.", "parameters": ADD}]
STREAM_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                "response.content_part.done", "response.output_item.done"]


def _client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="x", max_retries=0, timeout=600)


def _whole(client, **kw) -> Response:
    """The response, validated against the official client's model (not just constructed from it)."""
    raw = client.responses.with_raw_response.create(**kw)
    return Response.model_validate(raw.http_response.json())


def _streamed(client, **kw) -> tuple[list[str], str, Response]:
    """(its event types, consecutive deltas as one; the deltas joined; the final response) of a stream."""
    events = list(client.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    kinds = [k for i, k in enumerate(kinds) if not (k.endswith(".delta") and kinds[i - 1] == k)]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    return kinds, text, Response.model_validate(events[-1].response.to_dict())


# -- the default target --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default(launcher):
    target, _ = model_store.fetch()
    verifier = launcher.start("verifier", "verifier", ["--model", str(target), "--local-drafter", "suffix"])
    gateway = launcher.start("gateway", "gateway", ["--verifier", verifier.address], http=True)
    client = _client(gateway)
    return gateway, client, client.models.list().data[0].id


def test_text_whole_and_streamed_as_the_chat_request(default):
    _, client, model = default
    kw = dict(model=model, instructions="Answer in one sentence.", input="What is the capital of France?",
              max_output_tokens=12, temperature=0)
    whole = _whole(client, **kw)
    assert whole.id.startswith("resp_") and whole.object == "response" and whole.output[0].type == "message"
    assert whole.output_text and whole.usage.output_tokens <= 12
    assert whole.status == ("incomplete" if whole.usage.output_tokens == 12 else "completed")
    kinds, text, final = _streamed(client, **kw)
    assert kinds == STREAM_ORDER + [f"response.{final.status}"]
    assert text == final.output_text == whole.output_text  # greedy: the same text
    chat = client.chat.completions.create(model=model, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Answer in one sentence."},
        {"role": "user", "content": "What is the capital of France?"}])
    assert chat.choices[0].message.content == whole.output_text
    assert chat.usage.prompt_tokens == whole.usage.input_tokens


def test_json_schema_whole_and_streamed(default):
    _, client, model = default
    kw = dict(model=model, input="Give the weather in Paris as JSON.", max_output_tokens=60, temperature=0,
              text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}})
    whole = _whole(client, **kw)
    assert whole.status == "completed"
    jsonschema.validate(json.loads(whole.output_text), WEATHER)
    kinds, text, final = _streamed(client, **kw, extra_body={"speculative": {"num_speculative_tokens": 4}})
    assert kinds == STREAM_ORDER + ["response.completed"] and text == final.output_text == whole.output_text


def test_tools_stored_state_and_bad_fields_are_400s(default):
    _, client, model = default
    for kw, param in [(dict(tools=TOOLS), "tools"), (dict(store=True), "store"),
                      (dict(previous_response_id="resp_1"), "previous_response_id"),
                      (dict(max_output_tokens=0), "max_output_tokens")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=model, input="Hi", **kw)
        assert e.value.body["param"] == param, e.value.body
        if param in ("store", "previous_response_id"):
            assert "stateless" in e.value.body["message"]


def test_tokenize_detokenize(default):
    gateway, client, model = default
    base = f"http://{gateway.address}"
    prompt = "Spéculative decoding, 投机解码 🚀\n  def f(x): return x"
    got = httpx.post(f"{base}/tokenize", json={"model": model, "prompt": prompt}).json()
    assert got["count"] == len(got["tokens"]) > 0 and got["max_model_len"] > got["count"]
    assert httpx.post(f"{base}/detokenize", json={"model": model, "tokens": got["tokens"]}).json() == {"prompt": prompt}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]
    counted = httpx.post(f"{base}/tokenize", json={"model": model, "messages": messages}).json()
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
    assert counted["count"] == chat.usage.prompt_tokens
    bad = httpx.post(f"{base}/detokenize", json={"tokens": [0, 10 ** 7]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


# -- a model whose template takes tools ----------------------------------------------------------


@pytest.fixture(scope="module")
def qwen(launcher, tmp_path_factory):
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    import real_vocabs

    path = real_vocabs.write_model(real_vocabs.qwen25(), "qwen2", tmp_path_factory.mktemp("qwen25"))
    service = launcher.start("up", "up", ["--target", str(path), "--verifier-port", str(launcher.free_port()),
                                          "--metrics-port", "0", "--threads", "1"], http=True)
    client = _client(service)
    return service, client, client.models.list().data[0].id


ASK = "What is the weather in Paris?"
FORCED = dict(input=ASK, tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"},
              parallel_tool_calls=False, max_output_tokens=80, temperature=0)


def _call(response: Response, params: dict = WEATHER):
    """The response's one function call; its arguments validate against the function's parameters."""
    assert response.status == "completed", response
    (item,) = [o for o in response.output if o.type == "function_call"]
    assert item.call_id.startswith("call_") and item.id.startswith("fc_") and item.status == "completed"
    jsonschema.validate(json.loads(item.arguments), params)
    return item


def test_a_forced_function_call_whole_streamed_and_without_speculation(qwen):
    _, client, model = qwen
    whole = _whole(client, model=model, **FORCED, extra_body={"speculative": {"num_speculative_tokens": 4}})
    item = _call(whole)
    assert item.name == "get_weather" and [o.type for o in whole.output] == ["function_call"]
    off = _call(_whole(client, model=model, **FORCED, extra_body={"speculative": {"num_speculative_tokens": 0}}))
    assert (off.name, off.arguments) == (item.name, item.arguments)  # greedy: the same call
    events = list(client.responses.create(model=model, stream=True, **FORCED))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert events[4].arguments == item.arguments and events[4].name == "get_weather"
    streamed = _call(Response.model_validate(events[-1].response.to_dict()))
    assert (streamed.name, streamed.arguments) == (item.name, item.arguments)
    required = _whole(client, model=model, **{**FORCED, "tool_choice": "required"})
    (call,) = [o for o in required.output if o.type == "function_call"]
    _call(required, {"get_weather": WEATHER, "add": ADD}[call.name])


def test_the_call_and_its_result_go_back_as_the_chat_turn(qwen):
    gateway, client, model = qwen
    item = _call(_whole(client, model=model, **FORCED))
    result = {"type": "function_call_output", "call_id": item.call_id, "output": "18 degrees"}
    turn = _whole(client, model=model, input=[{"role": "user", "content": ASK}, item.to_dict(), result],
                  tools=TOOLS, max_output_tokens=4, temperature=0)
    call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
    messages = [{"role": "user", "content": ASK}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": item.call_id, "content": "18 degrees"}]
    chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
    chat = client.chat.completions.create(model=model, messages=messages, tools=chat_tools, max_tokens=4,
                                          temperature=0)
    assert turn.usage.input_tokens == chat.usage.prompt_tokens
    assert turn.output_text == (chat.choices[0].message.content or "")
    counted = httpx.post(f"http://{gateway.address}/tokenize", json={"messages": messages, "tools": chat_tools})
    assert counted.json()["count"] == chat.usage.prompt_tokens


def test_json_schema_on_random_weights(qwen):
    _, client, model = qwen
    r = _whole(client, model=model, input=ASK, max_output_tokens=80, temperature=0,
               text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), WEATHER)
