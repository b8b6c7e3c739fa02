"""The models users bring, through `specd up --target FILE.gguf` and nothing else (issue 68).

Each model has the hard parts of a real one (tests/real_vocabs.py): a real tokenizer of 128k-262k
entries with its added and control tokens, the model's published chat template with tools, and
random weights of a small shape. Through the official client:
- Qwen2.5 (151,936 tokens; <tool_call> and </tool_call> are added tokens): `specd up --target`
  picks its drafters alone and says so, and with `--drafter draft_model:FILE` serves that draft
  model beside the suffix index; forced tool calls come back as tool_calls that name a
  declared function and validate against its parameters, the same with speculation off and on;
  streamed deltas reassemble to the whole response's calls; a tool result goes back through the
  template (the markers as the single tokens the model knows); JSON-schema output validates.
- Llama 3.1 (128,256 tokens; JSON calls, <|python_tag|>): forced calls, off/on identical, the tool
  turn through its template.
- A 262,144-token byte-level BPE (its tokenizer.json is 19.6 MB, nearly five times gRPC's default
  message limit): the gateway gets it from the verifier and chats.
"""
from __future__ import annotations

import json

import openai
import pytest

pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
jsonschema = pytest.importorskip("jsonschema")

import real_vocabs  # noqa: E402
from services.gateway import tools  # noqa: E402
from specd.models import chat  # noqa: E402

pytestmark = pytest.mark.timeout(1200)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                         "b": {"type": "integer", "minimum": -99, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]
TOOL_TURN = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
SPEC = [0, 4]  # num_speculative_tokens: off, then a fixed k


def _up(launcher, target, *flags):
    """`specd up --target FILE` with only the ports and thread count of a shared test machine."""
    service = launcher.start("up", "up", ["--target", str(target), "--verifier-port", str(launcher.free_port()),
                                          "--metrics-port", "0", "--threads", "1", *flags], http=True)
    client = openai.OpenAI(base_url=f"http://{service.address}/v1", api_key="x", max_retries=0, timeout=600)
    return service, client, client.models.list().data[0].id


def _offline_tokenizer(gguf_file):
    from specd.engine.loader import resolve_model_dir
    from specd.models.tokenizer import Tokenizer

    return Tokenizer.from_dir(resolve_model_dir(str(gguf_file), weights=False))


def _calls(choice, names) -> list[tuple[str, dict]]:
    assert choice.finish_reason == "tool_calls", choice
    out = []
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, PARAMS[call.function.name])
        out.append((call.function.name, args))
    return out


def _forced_calls_are_exact(client, model, tool_choice, names) -> list[tuple[str, dict]]:
    """Forced calls with speculation off and on (greedy: the same calls), then streamed: the deltas
    reassemble to the whole response's calls. One call per answer: greedy random weights would add
    calls until max_tokens."""
    kw = dict(model=model, messages=ASK, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
              max_tokens=120, temperature=0)
    got = []
    for k in SPEC:
        r = client.chat.completions.create(**kw,
                                           extra_body={"speculative": {"num_speculative_tokens": k}})
        got.append(_calls(r.choices[0], names))
    assert got[0] == got[1]
    streamed, finish = {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for d in chunk.choices[0].delta.tool_calls or []:
            streamed[d.index] = (d.function.name, json.loads(d.function.arguments))
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and [streamed[i] for i in sorted(streamed)] == got[0]
    return got[0]


# -- Qwen2.5 -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen25_file(tmp_path_factory):
    return real_vocabs.write_model(real_vocabs.qwen25(), "qwen2", tmp_path_factory.mktemp("qwen25"))


@pytest.fixture(scope="module")
def qwen25(launcher, qwen25_file):
    service, client, model = _up(launcher, qwen25_file)
    return service, client, model


def test_up_with_only_a_target_picks_and_says_its_drafters(qwen25):
    service, client, model = qwen25
    assert model == "model.gguf"
    # the default target's datastore is of another vocabulary: the suffix index drafts from the requests alone
    assert "drafters: none named, so the suffix index inside the verifier" in service.log_text()
    assert "not the default datastore: it is of another vocabulary" in service.log_text()
    r = client.chat.completions.create(model=model, messages=ASK, max_tokens=8, temperature=0)
    assert r.usage.completion_tokens == 8 and r.choices[0].message.content


def test_a_named_draft_model_of_the_vocabulary_drafts_beside_the_suffix_index(launcher, qwen25_file):
    """`specd up --target T --drafter draft_model:D` on a 151,936-token vocabulary: the draft model runs
    as a service and the suffix index stays inside the verifier (both said); a request that names the
    draft model gets its drafts, and with D = T (the same weights) greedy drafts are all accepted and
    the text is plain decoding's."""
    service, client, model = _up(launcher, qwen25_file, "--drafter", f"draft_model:{qwen25_file}")
    assert "drafters: draft_model as a service, and the suffix index inside the verifier" in service.log_text()
    kw = dict(model=model, messages=ASK, max_tokens=24, temperature=0)
    plain = client.chat.completions.create(**kw, extra_body={"speculative": {"num_speculative_tokens": 0}})
    drafted = client.chat.completions.create(
        **kw, extra_body={"speculative": {"drafter": "draft_model", "num_speculative_tokens": 4}})
    assert drafted.choices[0].message.content == plain.choices[0].message.content
    spec = drafted.usage.model_extra["speculative"]
    assert set(spec["drafters"]) == {"draft_model"} and spec["drafts"] > 0
    assert spec["accepted_tokens"] == spec["draft_tokens"] > 0


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_qwen25_forced_tool_calls_with_its_added_tokens(qwen25, tool_choice):
    _, client, model = qwen25
    names = {"add"} if isinstance(tool_choice, dict) else set(PARAMS)
    _forced_calls_are_exact(client, model, tool_choice, names)


def test_qwen25_tool_turn_goes_through_its_template_as_tokens(qwen25, qwen25_file):
    _, client, model = qwen25
    tok = _offline_tokenizer(qwen25_file)
    r = client.chat.completions.create(model=model, messages=TOOL_TURN, tools=TOOLS, max_tokens=4, temperature=0)
    text = chat.render_chat(tok, tools.template_messages(TOOL_TURN), tools=TOOLS)
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in text
    assert "<tool_response>\n5\n</tool_response>" in text
    ids = tok.encode(text, add_special_tokens=False)
    assert r.usage.prompt_tokens == len(ids)
    # the call the model made is in its prompt as the marker tokens it emits, not as their letters
    open_id, close_id = tok.added_token_id("<tool_call>"), tok.added_token_id("</tool_call>")
    assert (open_id, close_id) == (151657, 151658) and ids.count(open_id) == ids.count(close_id) >= 2


def test_qwen25_json_schema(qwen25):
    _, client, model = qwen25
    schema = PARAMS["get_weather"]
    for k in SPEC:
        r = client.chat.completions.create(
            model=model, messages=ASK, max_tokens=80, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
            extra_body={"speculative": {"num_speculative_tokens": k}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_auto_reads_a_call_made_of_marker_tokens(qwen25_file):
    """What "auto" reads back from a Qwen2.5 model's own tokens: the markers as the added tokens."""
    from specd.models.detokenizer import IncrementalDetokenizer

    tok = _offline_tokenizer(qwen25_file)
    fmt = tools.tool_format(tok)
    assert fmt.name == "hermes" and fmt.marker_ids == {"<tool_call>": 151657, "</tool_call>": 151658}
    ids = ([*tok.encode("Sure.\n"), 151657] + tok.encode('\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n')
           + [151658, real_vocabs.QWEN25_IM_END])
    detok = IncrementalDetokenizer(tok, [], keep=fmt.keep_token_ids)
    text = "".join(detok.add(t) for t in ids) + detok.flush()
    content, calls = tools.parse(text, set(PARAMS), fmt)
    assert content == "Sure." and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("add", {"a": 1, "b": 2})]


# -- Llama 3.1 -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama31_file(tmp_path_factory):
    return real_vocabs.write_model(real_vocabs.llama31(), "llama", tmp_path_factory.mktemp("llama31"), context=131072)


def test_llama31_json_tool_calls(launcher, llama31_file):
    _, client, model = _up(launcher, llama31_file)
    tok = _offline_tokenizer(llama31_file)
    fmt = tools.tool_format(tok)
    assert fmt.name == "llama3_json" and fmt.marker_ids == {"<|python_tag|>": 128010}
    _forced_calls_are_exact(client, model, {"type": "function", "function": {"name": "add"}}, {"add"})
    _forced_calls_are_exact(client, model, "required", set(PARAMS))
    r = client.chat.completions.create(model=model, messages=TOOL_TURN, tools=TOOLS, max_tokens=4, temperature=0)
    text = chat.render_chat(tok, tools.template_messages(TOOL_TURN), tools=TOOLS)
    assert '{"name": "add", "parameters": {"a": 2, "b": 3}}<|eot_id|>' in text
    # (the template writes any iterable content, a string too, as JSON: as transformers renders it)
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"5"<|eot_id|>' in text
    assert r.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))
    # "auto": the model's <|python_tag|> (a control token) reaches the parser, which reads the call after it
    from specd.models.detokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(tok, [], keep=fmt.keep_token_ids)
    ids = [128010, *tok.encode('{"name": "add", "parameters": {"a": 1, "b": 2}}', add_special_tokens=False), 128009]
    text = "".join(detok.add(t) for t in ids) + detok.flush()
    assert text.startswith("<|python_tag|>")
    assert tools.parse(text, set(PARAMS), fmt)[1][0]["function"]["name"] == "add"


# -- 262,144 tokens ------------------------------------------------------------------------------


def test_a_262k_vocabulary_serves_through_up(launcher, tmp_path_factory):
    vocab = real_vocabs.wide()
    path = real_vocabs.write_model(vocab, "qwen2", tmp_path_factory.mktemp("wide"))
    tok = _offline_tokenizer(path)
    assert tok.vocab_size == real_vocabs.WIDE_VOCAB
    from specd.engine.loader import resolve_model_dir

    assert (resolve_model_dir(str(path), weights=False) / "tokenizer.json").stat().st_size > 4 * 4 * 2**20
    _, client, model = _up(launcher, path)
    messages = [{"role": "user", "content": "Hello there, what is 12345?"}]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    assert r.usage.prompt_tokens == len(chat.chat_prompt_ids(tok, messages))
    assert r.usage.completion_tokens == 6
    # the vocabulary's last ids are real tokens: a prompt of them comes back as the same ids
    last = list(range(real_vocabs.WIDE_VOCAB - 3, real_vocabs.WIDE_VOCAB))
    c = client.completions.create(model=model, prompt=last, max_tokens=1, temperature=0)
    assert c.usage.prompt_tokens == 3
