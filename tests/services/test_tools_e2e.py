"""Tool calling over HTTP with the official client (issue 30).

A tiny random qwen2 model with a Hermes-style (Qwen2.5) chat template and the default target's
tokenizer, served by real verifier, suffix drafter and gateway processes. tool_choice "required"
and a named function constrain the output to tool-call blocks: every call parses, names a
declared function and its arguments validate against the function's parameters, with and without
speculation (greedy: the same calls), whole and streamed. Tool results go back through the
template. A model whose template takes no tools (SmolLM2's) answers 400; reading calls back from
free text ("auto") is checked on text written here.
"""
from __future__ import annotations

import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from json_schemas import SCHEMAS
from services.gateway import tools
from specd.models import chat, model_store
from specd.models.tokenizer import Tokenizer
from specd.v1 import verifier_pb2 as pb
from specd.v1 import verifier_pb2_grpc as pbg

jsonschema = pytest.importorskip("jsonschema")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(900)

# Qwen2.5-Instruct's tool layout (its published chat template, shortened to what these tests use).
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful assistant.{% endif %}

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant{% if message.content %}
{{ message.content }}{% endif %}
{%- for call in message.tool_calls %}{% set call = call.function %}
<tool_call>
{"name": "{{ call.name }}", "arguments": {{ call.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}
<tool_response>
{{ message.content }}
</tool_response>{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                         "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]


@pytest.fixture(scope="module")
def qwen2_with_tools(tmp_path_factory):
    src = model_store.fetch()[0]
    out = tmp_path_factory.mktemp("qwen2_tools")
    cfg = transformers.Qwen2Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                   tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)  # 2: <|im_end|>
    import torch

    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, out / name)
    (out / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    return out


@pytest.fixture(scope="module")
def stack(launcher, qwen2_with_tools):
    suffix = launcher.start("suffix", "drafter", ["--method", "suffix"])
    verifier = launcher.start("verifier", "verifier", [
        "--model", str(qwen2_with_tools), "--drafter", f"suffix={suffix.address}",
        "--speculative-config", json.dumps({"num_speculative_tokens": 4, "adaptive": False})])
    gateway = launcher.start("gateway", "gateway", ["--verifier", verifier.address], http=True)
    stub = pbg.VerifierStub(grpc.insecure_channel(verifier.address))
    deadline = time.monotonic() + 60
    while not any(d.healthy for d in stub.ListDrafters(pb.ListDraftersRequest(), timeout=10).drafters):
        assert time.monotonic() < deadline, "the suffix drafter never registered"
        time.sleep(0.2)
    client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="x", max_retries=0, timeout=300)
    return client, client.models.list().data[0].id


def _check_calls(calls, names) -> list[tuple[str, dict]]:
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, PARAMS[call.function.name])
        out.append((call.function.name, args))
    return out


@pytest.mark.parametrize("tool_choice, parallel", [("required", True), ("required", False),
                                                   ({"type": "function", "function": {"name": "add"}}, True)])
def test_forced_calls_parse_and_name_a_declared_function(stack, tool_choice, parallel):
    client, model = stack
    names = {"add"} if isinstance(tool_choice, dict) else set(PARAMS)
    got = {}
    for k in (0, 4):
        r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                                           parallel_tool_calls=parallel, max_tokens=400, temperature=0,
                                           extra_body={"speculative": {"num_speculative_tokens": k}})
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        got[k] = _check_calls(choice.message.tool_calls, names)
        assert parallel or len(got[k]) == 1
    assert got[0] == got[4]  # greedy: speculation changes nothing


def test_json_schemas_on_a_qwen2_model(stack):
    """The JSON-schema corpus on this random qwen2: every output valid, with and without
    speculation. Sampled (T = 1, seeded): greedy on random weights repeats one digit of a number
    forever (JSON bounds no digits), which no grammar can end; the default pair's greedy corpus
    (test_structured_e2e.py) checks identity."""
    client, model = stack
    for k in (0, 4):
        def ask(i, k=k):
            request, schema, _ = SCHEMAS[i]
            return client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": request}], max_tokens=400, temperature=1.0,
                seed=i, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
                extra_body={"speculative": {"num_speculative_tokens": k}}).choices[0]
        with ThreadPoolExecutor(len(SCHEMAS)) as pool:
            choices = list(pool.map(ask, range(len(SCHEMAS))))
        for choice, (_, schema, _) in zip(choices, SCHEMAS):
            assert choice.finish_reason == "stop", choice.message.content[-200:]
            jsonschema.validate(json.loads(choice.message.content), schema)


def test_streamed_tool_calls_are_the_whole_response_s(stack):
    client, model = stack
    kw = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=400, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    calls, finish = {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for d in chunk.choices[0].delta.tool_calls or []:
            calls[d.index] = (d.function.name, json.loads(d.function.arguments))
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [(c.function.name, json.loads(c.function.arguments)) for c in whole]


def test_tool_results_go_back_through_the_template(stack, qwen2_with_tools):
    client, model = stack
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    r = client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=5, temperature=0)
    text = chat.render_chat(Tokenizer.from_dir(qwen2_with_tools), tools.template_messages(history), tools=TOOLS)
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in text
    assert "<tool_response>\n5\n</tool_response>" in text
    assert r.usage.prompt_tokens == len(Tokenizer.from_dir(qwen2_with_tools).encode(text))


@pytest.mark.parametrize("kw, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "always"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tool_requests_are_a_400(stack, kw, param):
    client, model = stack
    body = {"tools": TOOLS, "tool_choice": "required", **kw}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4, **body)
    assert err.value.body["param"] == param, err.value.body


# Hermes as it reads in a vocabulary where its markers are text (SmolLM2's): no marker tokens.
HERMES = tools.ToolFormat("hermes", "<tool_call>", "</tool_call>", "arguments", True, {})


def test_a_tool_that_is_not_an_object_is_a_clear_error():
    with pytest.raises(ValueError, match=r"tools\[0\] must be"):
        tools.check(["get_weather"], "auto", HERMES, HERMES_TEMPLATE)


def test_a_template_without_tools_is_a_clear_error():
    template = Tokenizer.from_dir(model_store.fetch()[0]).chat_template
    with pytest.raises(ValueError, match="does not take tools"):
        tools.check(TOOLS, "auto", None, template)


def test_auto_reads_calls_back_from_text():
    names = set(PARAMS)
    text = ('Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>')
    content, calls = tools.parse(text, names, HERMES)
    assert [c["function"]["name"] for c in calls] == ["add"] and json.loads(calls[0]["function"]["arguments"]) == {
        "a": 1, "b": 2}
    assert content.startswith("Let me check.") and "unknown" in content  # not a declared function: stays text
    assert tools.parse("no calls here", names, HERMES) == ("no calls here", [])
    # streamed in pieces that split the tags: the same content and call, nothing held back at the end
    parser, out, streamed = tools.StreamParser(names, HERMES), "", []
    for i in range(0, len(text), 3):
        piece, calls = parser.feed(text[i:i + 3])
        out, streamed = out + piece, streamed + calls
    rest, last = parser.finish()
    out, streamed = out + rest, streamed + last
    assert [c["function"]["name"] for c in streamed] == ["add"]
    assert out.startswith("Let me check.") and "unknown" in out and "<tool_call>\n{\"name\": \"add\"" not in out
