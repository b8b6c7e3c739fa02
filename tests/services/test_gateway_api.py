"""Gateway HTTP API against a scripted verifier: request validation, response shapes,
SSE framing, stop strings, gRPC error mapping, auth, body limits, admin proxy, metrics.

The verifier here is a real gRPC server (grpc's sync server, in this process) that
streams a fixed reply, so every byte the gateway handles crosses the real wire; the
end-to-end tests against the real verifier are in test_gateway_e2e.py. Behaviour is
steered per request through the `speculative.drafter` field ("error:CODE", "slow", ...),
which the gateway passes through untouched.
"""
from __future__ import annotations

import json
import signal
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from starlette.testclient import TestClient

from specd.models.demo_paths import demo_model_dir
from specd.gateway.app import build_app
from specd.gateway.config import GatewayConfig, ModelInfo
from specd.gateway.prompts import chat_prompt_ids
from specd.models.tokenizer import Tokenizer
from specd.v1 import verifier_pb2 as pb
from specd.v1 import verifier_pb2_grpc

MODEL = "specd-demo-target"
MAX_MODEL_LEN = 64
REPLY = "Hello wörld 世界! 🎉 The end."
EOS = 1
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


class FakeVerifier(verifier_pb2_grpc.VerifierServicer):
    """Replies with the tokens of REPLY (then EOS), two per chunk, cut at max_tokens."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.vocab_hash = tok.vocab_hash()
        self.reply_ids = tok.encode(REPLY, add_special_tokens=False)
        self.requests: dict[str, pb.GenerateRequest] = {}
        self.aborted: list[str] = []
        self.cancelled: list[str] = []  # "slow" requests whose stream ended (before its 20 s were up)
        self.removed: list[pb.RemoveDrafterRequest] = []

    def Info(self, request, context):
        return pb.InfoResponse(model=str(demo_model_dir("target")), model_name=MODEL, max_model_len=MAX_MODEL_LEN,
                               vocab_size=self.tok.vocab_size, vocab_hash=self.vocab_hash, eos_token_ids=[EOS])

    def Generate(self, request, context):
        self.requests[request.request_id] = request
        p, control = request.params, request.params.drafter
        if control.startswith("error:"):
            context.abort(getattr(grpc.StatusCode, control[6:]), f"fake verifier says {control[6:]}")
        if control == "stall":  # says nothing for 30 s (a stuck verifier) unless the call ends
            deadline = time.monotonic() + 30
            while context.is_active() and time.monotonic() < deadline:
                time.sleep(0.05)
            return
        if control == "slow":  # trickles tokens for 20 s unless the client goes away
            context.add_callback(lambda: self.cancelled.append(request.request_id))
            for i in range(400):
                yield pb.GenerateChunk(token_ids=[self.reply_ids[0]], prompt_tokens=len(request.prompt_token_ids),
                                       completion_tokens=i + 1)
                time.sleep(0.05)
            return
        ids = (self.reply_ids + [EOS])[:p.max_tokens]
        for i in range(0, len(ids), 2):
            if control == "error-after:UNAVAILABLE" and i > 0:
                context.abort(grpc.StatusCode.UNAVAILABLE, "fake verifier went away")
            step = ids[i:i + 2]
            last = i + 2 >= len(ids)
            # Alternatives: the chosen token first, then the next ids, each 1 nat less likely.
            top = [pb.TopLogprobs(token_ids=[t + j for j in range(p.top_logprobs)],
                                  logprobs=[-0.25 - j for j in range(p.top_logprobs)]) for t in step]
            yield pb.GenerateChunk(
                token_ids=step, logprobs=[-0.25] * len(step) if p.logprobs else [],
                top_logprobs=top if p.top_logprobs else [],
                finish_reason=("stop" if ids[-1] == EOS else "length") if last else "",
                prompt_tokens=len(request.prompt_token_ids), completion_tokens=i + len(step),
                spec=pb.SpecCounters(drafts=i // 2 + 1, draft_tokens=4 * (i // 2 + 1), accepted_tokens=i + len(step)))

    def Abort(self, request, context):
        self.aborted.append(request.request_id)
        return pb.AbortResponse(found=True)

    def ListDrafters(self, request, context):
        return pb.ListDraftersResponse(drafters=[pb.DrafterStatus(
            name="ngram-1", address="127.0.0.1:7001", method="ngram", state="healthy", healthy=True,
            proposals=10, draft_tokens=40, accepted_tokens=30, acceptance_rate=0.75)])

    def RegisterDrafter(self, request, context):
        if request.name == "ngram-1":
            context.abort(grpc.StatusCode.ALREADY_EXISTS, "drafter ngram-1 is already registered")
        if request.address == "bad":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "drafter vocabulary does not match the target's")
        return pb.RegisterDrafterResponse(drafter=pb.DrafterStatus(name=request.name, address=request.address,
                                                                   state="healthy", healthy=True))

    def RemoveDrafter(self, request, context):
        if request.name != "ngram-1":
            context.abort(grpc.StatusCode.NOT_FOUND, f"no drafter named {request.name}")
        self.removed.append(request)
        return pb.RemoveDrafterResponse()


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    t = Tokenizer.from_dir(demo_model_dir("target"))
    if t is None:
        pytest.skip("the bundled demo target is missing")
    return t


@pytest.fixture(scope="module")
def fake(tok):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    servicer = FakeVerifier(tok)
    verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server)
    servicer.health = health.HealthServicer()  # the gateway's /health asks it about the Verifier service
    health_pb2_grpc.add_HealthServicer_to_server(servicer.health, server)
    servicer.health.set("specd.v1.Verifier", health_pb2.HealthCheckResponse.SERVING)
    servicer.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    yield servicer
    server.stop(grace=None)


def make_client(tok, verifier: str, **config) -> TestClient:
    model = ModelInfo(name=MODEL, path=str(demo_model_dir("target")), max_model_len=MAX_MODEL_LEN,
                      vocab_size=tok.vocab_size)
    return TestClient(build_app(GatewayConfig(verifier=verifier, **config), model, tok))


@pytest.fixture(scope="module")
def client(tok, fake):
    with make_client(tok, fake.address, max_body_bytes=4096) as c:
        yield c


def events(response) -> list:
    """The SSE events of a response: parsed JSON objects, and the final "[DONE]"."""
    assert response.headers["content-type"].startswith("text/event-stream")
    raw = response.text
    assert raw.endswith("data: [DONE]\n\n")
    out = []
    for block in raw.split("\n\n")[:-1]:
        assert block.startswith("data: ")
        data = block[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_error(response, status: int, param: str | None = "", contains: str = "") -> dict:
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param != "":
        assert err["param"] == param, err
    assert contains.lower() in err["message"].lower(), err
    return err


# ---------------------------------------------------------------- happy paths


def test_completion_whole_and_streamed_give_the_same_text(client, fake):
    body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 32}
    whole = client.post(COMPLETIONS, json=body).json()
    assert whole["object"] == "text_completion" and whole["id"].startswith("cmpl-") and whole["model"] == MODEL
    (choice,) = whole["choices"]
    assert choice == {"index": 0, "text": REPLY, "logprobs": None, "finish_reason": "stop"}
    n = len(fake.reply_ids) + 1  # + EOS
    assert whole["usage"]["completion_tokens"] == n
    assert whole["usage"]["total_tokens"] == whole["usage"]["prompt_tokens"] + n
    drafts = (n + 1) // 2
    assert whole["usage"]["speculative"] == {"drafts": drafts, "draft_tokens": 4 * drafts, "accepted_tokens": n,
                                             "accepted_per_pos": [], "mean_acceptance_length": 1 + n / drafts,
                                             "drafters": {}}

    evs = events(client.post(COMPLETIONS, json={**body, "stream": True, "stream_options": {"include_usage": True}}))
    chunks, usage_chunk, done = evs[:-2], evs[-2], evs[-1]
    assert done == "[DONE]"
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert len(chunks) > 3 and not any("\ufffd" in c["choices"][0]["text"] for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == REPLY
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]


def test_chat_stream_starts_with_the_role_and_matches_the_whole_response(client, fake, tok):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    whole = client.post(CHAT, json={"model": MODEL, "messages": messages}).json()
    assert whole["object"] == "chat.completion" and whole["id"].startswith("chatcmpl-")
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": REPLY}
    sent = fake.requests[whole["id"]]
    expected_ids = chat_prompt_ids(tok, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert list(sent.prompt_token_ids) == expected_ids and expected_ids.count(0) == 1 and expected_ids[0] == 0
    assert sent.params.max_tokens == MAX_MODEL_LEN - len(expected_ids)  # default: the rest of the context

    evs = events(client.post(CHAT, json={"model": MODEL, "messages": messages, "stream": True}))
    assert evs[0]["object"] == "chat.completion.chunk"
    assert evs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    chunks = evs[1:-1]
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == REPLY
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and "usage" not in chunks[-1]


@pytest.mark.parametrize("form", ["text", "text-list", "ids", "ids-list"])
def test_completion_prompt_forms(client, fake, tok, form):
    ids = tok.encode("def f(x):")
    prompt = {"text": "def f(x):", "text-list": ["def f(x):"], "ids": ids, "ids-list": [ids]}[form]
    r = client.post(COMPLETIONS, json={"model": MODEL, "prompt": prompt, "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert list(fake.requests[r.json()["id"]].prompt_token_ids) == ids
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["choices"][0]["text"] == tok.decode(fake.reply_ids[:4])


def test_sampling_fields_reach_the_verifier(client, fake):
    r = client.post(COMPLETIONS, json={
        "prompt": "x", "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.1, "seed": 42,
        "stop_token_ids": [5], "ignore_eos": True, "user": "u1", "n": 1, "presence_penalty": 0,
        "speculative": {"num_speculative_tokens": 0, "drafter": "ngram-1"}})
    assert r.status_code == 200, r.text
    p = fake.requests[r.json()["id"]].params
    assert (p.max_tokens, p.top_k, p.seed, list(p.stop_token_ids), p.ignore_eos, p.drafter) == (3, 7, 42, [5], True,
                                                                                               "ngram-1")
    assert p.temperature == pytest.approx(0.5) and p.top_p == pytest.approx(0.9) and p.min_p == pytest.approx(0.1)
    assert p.HasField("num_speculative_tokens") and p.num_speculative_tokens == 0 and not p.logprobs


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_text_and_aborts_the_sequence(client, fake, stream):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 40, "stop": ["🎉", "never"], "stream": stream}
    r = client.post(COMPLETIONS, json=body)
    if stream:
        chunks = events(r)[:-1]
        text, finish, rid = "".join(c["choices"][0]["text"] for c in chunks), chunks[-1]["choices"][0][
            "finish_reason"], chunks[0]["id"]
    else:
        text, finish, rid = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"], r.json()["id"]
    assert text == REPLY[:REPLY.index("🎉")] and finish == "stop"
    assert rid in fake.aborted


def test_logprobs_shapes(client, fake, tok):
    chat = client.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True,
                                   "top_logprobs": 0}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == [-0.25] * 3
    assert [c["token"] for c in content] == [tok.decode([t], skip_special_tokens=False) for t in fake.reply_ids[:3]]
    assert all(c["top_logprobs"] == [] and c["bytes"] == list(c["token"].encode()) for c in content)

    comp = client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 3, "logprobs": 0}).json()
    lp = comp["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [-0.25] * 3 and len(lp["tokens"]) == 3
    assert lp["top_logprobs"] == [{t: -0.25} for t in lp["tokens"]]  # the sampled token is always there
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


def _text(tok, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


@pytest.mark.parametrize("stream", [False, True])
def test_top_logprobs_shapes(client, fake, tok, stream):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "logprobs": True, "top_logprobs": 3,
            "stream": stream}
    r = client.post(CHAT, json=body)
    if stream:
        evs = events(r)[:-1]
        content = [c for e in evs if e["choices"][0]["logprobs"] for c in e["choices"][0]["logprobs"]["content"]]
        rid = evs[0]["id"]
    else:
        content, rid = r.json()["choices"][0]["logprobs"]["content"], r.json()["id"]
    assert fake.requests[rid].params.top_logprobs == 3 and fake.requests[rid].params.logprobs
    assert len(content) == 5
    for t, c in zip(fake.reply_ids, content):
        assert c["top_logprobs"] == [{"token": _text(tok, t + j), "logprob": -0.25 - j,
                                      "bytes": list(_text(tok, t + j).encode())} for j in range(3)]

    comp = client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 5, "logprobs": 2}).json()
    lp = comp["choices"][0]["logprobs"]
    assert fake.requests[comp["id"]].params.top_logprobs == 2
    expected = []
    for t in fake.reply_ids[:5]:  # byte tokens share the text "\ufffd": the more likely one keeps the key
        expected.append({})
        for j in range(2):
            expected[-1].setdefault(_text(tok, t + j), -0.25 - j)
    assert lp["top_logprobs"] == expected


def test_models_health_and_metrics(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    (m,) = models["data"]
    assert (m["id"], m["object"], m["owned_by"], m["max_model_len"]) == (MODEL, "model", "specd", MAX_MODEL_LEN)
    assert client.get("/health").status_code == 200
    client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 6})  # three chunks: TTFT, then two gaps
    text = client.get("/metrics").text
    assert 'specd_gateway_requests_total{endpoint="/v1/completions",status="200"}' in text
    for name in ("time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count"):
        line = next(ln for ln in text.splitlines() if ln.startswith(f"specd_gateway_{name}"))
        assert float(line.split()[-1]) >= 1, line
    assert "specd_gateway_requests_running 0.0" in text


# ---------------------------------------------------------------- bad requests

def _nested(depth: int) -> dict:
    out: dict = {"type": "text"}
    for _ in range(depth):
        out = {"type": "text", "inner": out}
    return out


BAD = [
    # (endpoint, body (dict, or raw bytes), status, param, message fragment)
    (CHAT, b"{not json", 400, None, "not valid JSON"),
    (CHAT, b"[1, 2]", 400, None, "JSON object"),
    (CHAT, {"model": MODEL}, 400, "messages", "Missing required parameter"),
    (CHAT, {"messages": "hi"}, 400, "messages", ""),
    (CHAT, {"messages": []}, 400, "messages", "empty"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages", "role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages", "messages.0.content"),
    (COMPLETIONS, {}, 400, "prompt", "Missing required parameter"),
    (COMPLETIONS, {"prompt": 5}, 400, "prompt", "Invalid type"),
    (COMPLETIONS, {"prompt": []}, 400, "prompt", "empty"),
    (COMPLETIONS, {"prompt": ["a", "b"]}, 400, "prompt", "one prompt"),
    (COMPLETIONS, {"prompt": [1, 10 ** 9]}, 400, "prompt", "token ids"),
    (COMPLETIONS, {"prompt": "x", "temperature": -0.1}, 400, "temperature", "temperature"),
    (COMPLETIONS, {"prompt": "x", "temperature": "hot"}, 400, "temperature", "valid number"),
    (COMPLETIONS, {"prompt": "x", "top_p": 1.5}, 400, "top_p", "top_p"),
    (COMPLETIONS, {"prompt": "x", "top_k": -2}, 400, "top_k", "top_k"),
    (COMPLETIONS, {"prompt": "x", "min_p": 2}, 400, "min_p", "min_p"),
    (COMPLETIONS, {"prompt": "x", "seed": -1}, 400, "seed", "seed"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": "3"}, 400, "max_tokens", "valid integer"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens", str(MAX_MODEL_LEN)),
    (COMPLETIONS, {"prompt": "x " * MAX_MODEL_LEN}, 400, "prompt", "maximum context length"),
    (COMPLETIONS, {"prompt": "x", "model": "gpt-4"}, 404, "model", "does not exist"),
    (COMPLETIONS, {"prompt": "x", "n": 0}, 400, "n", "between 1 and 16"),
    (COMPLETIONS, {"prompt": "x", "n": 17}, 400, "n", "between 1 and 16"),
    (COMPLETIONS, {"prompt": "x", "n": 2, "best_of": 3}, 400, "best_of", "equal to n"),
    (COMPLETIONS, {"prompt": "x", "echo": True}, 400, "echo", "not supported"),
    (COMPLETIONS, {"prompt": "x", "suffix": "end"}, 400, "suffix", "not supported"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 6}, 400, "logprobs", "between 0 and 5"),
    (COMPLETIONS, {"prompt": "x", "logprobs": -1}, 400, "logprobs", "between 0 and 5"),
    (COMPLETIONS, {"prompt": "x", "logprobs": True}, 400, "logprobs", "valid integer"),
    (COMPLETIONS, {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty", "[-2, 2]"),
    (COMPLETIONS, {"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty", "[-2, 2]"),
    (COMPLETIONS, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", "(0, 10]"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"five": 10}}, 400, "logit_bias", "token ids"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"99999999": 10}}, 400, "logit_bias", "token ids must be in"),
    (COMPLETIONS, {"prompt": "x", "min_tokens": 9, "max_tokens": 4}, 400, "min_tokens", "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    (COMPLETIONS, {"prompt": "x", "speculative": {"num_speculative_tokens": -1}}, 400, "num_speculative_tokens", ""),
    (COMPLETIONS, {"prompt": "x", "speculative": {"k": 2}}, 400, "speculative", ""),
    (COMPLETIONS, {"prompt": "x", "frobnicate": 1}, 400, "frobnicate", "Unrecognized"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400, "tools", ""),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, 400,
     "response_format", "json_schema"),
    (COMPLETIONS, {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}, 400,
     "response_format", "schema"),
    (COMPLETIONS, {"prompt": "x", "structured_outputs": {"regex": "(a"}}, 400, "structured_outputs", "regex"),
    (COMPLETIONS, {"prompt": "x", "structured_outputs": {"json": "{nope"}}, 400, "structured_outputs", "JSON"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs", "between 0 and 20"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": -1}, 400,
     "top_logprobs", "between 0 and 20"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs",
     "requires logprobs"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "logprobs": False, "top_logprobs": 0}, 400,
     "top_logprobs", "requires logprobs"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, 400, "max_tokens", ""),
    # Values that overflow the gRPC message, text that is not Unicode, JSON no parser should recurse into:
    (COMPLETIONS, {"prompt": "x", "top_k": 2 ** 31}, 400, "top_k", "up to 2147483647"),
    (COMPLETIONS, {"prompt": "x", "top_k": 2 ** 63}, 400, "top_k", "up to 2147483647"),
    (COMPLETIONS, {"prompt": "x", "stop_token_ids": [2 ** 32]}, 400, "stop_token_ids", "token ids"),
    (COMPLETIONS, {"prompt": "x", "stop_token_ids": [5, 10 ** 6]}, 400, "stop_token_ids", "1000000"),
    (COMPLETIONS, b'{"prompt": "a\\ud800b"}', 400, "prompt", "surrogate"),
    (COMPLETIONS, b'{"prompt": "x", "stop": ["ok", "\\uDC00"]}', 400, "stop", "surrogate"),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "messages", "surrogate"),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udfff"}]}]}', 400, "messages",
     "messages.0.content.0.text"),
    (COMPLETIONS, b'{"prompt": ' + b"[" * 1900 + b"]" * 1900 + b"}", 400, None, "nests deeper"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "response_format": _nested(100)}, 400, "response_format",
     "nests deeper"),
]


@pytest.mark.parametrize("endpoint,body,status,param,fragment", BAD, ids=[str(b)[:60] for _, b, *_ in BAD])
def test_bad_requests_get_an_openai_error_and_the_gateway_keeps_serving(client, fake, endpoint, body, status, param,
                                                                        fragment):
    n_requests = len(fake.requests)
    if isinstance(body, bytes):
        r = client.post(endpoint, content=body, headers={"content-type": "application/json"})
    else:
        r = client.post(endpoint, json=body)
    assert_error(r, status, param, fragment)
    assert len(fake.requests) == n_requests  # rejected before reaching the verifier
    assert client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_unknown_route_and_wrong_method(client):
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get(COMPLETIONS), 405)


def test_body_over_the_limit_is_413_declared_or_streamed(client):
    big = json.dumps({"prompt": "x" * 5000}).encode()
    assert_error(client.post(COMPLETIONS, content=big, headers={"content-type": "application/json"}), 413,
                 contains="4096")
    # No Content-Length (chunked): the limit is enforced on the bytes as they arrive.
    assert_error(client.post(COMPLETIONS, content=(big[i:i + 1000] for i in range(0, len(big), 1000)),
                             headers={"content-type": "application/json"}), 413)
    assert client.get("/health").status_code == 200


# ---------------------------------------------------------------- verifier errors


@pytest.mark.parametrize("code,status", [("INVALID_ARGUMENT", 400), ("RESOURCE_EXHAUSTED", 429),
                                         ("UNAVAILABLE", 503), ("INTERNAL", 500)])
@pytest.mark.parametrize("stream", [False, True])
def test_verifier_status_maps_to_http(client, code, status, stream):
    r = client.post(COMPLETIONS, json={"prompt": "x", "stream": stream, "speculative": {"drafter": f"error:{code}"}})
    assert_error(r, status, contains=f"fake verifier says {code}")


def test_queue_full_is_429_with_retry_after(client):
    for stream in (False, True):
        r = client.post(COMPLETIONS, json={"prompt": "x", "stream": stream,
                                           "speculative": {"drafter": "error:RESOURCE_EXHAUSTED"}})
        err = assert_error(r, 429, contains="fake verifier says")
        assert err["type"] == "rate_limit_error" and r.headers["retry-after"] == "1"


@pytest.mark.parametrize("stream", [False, True])
def test_a_silent_verifier_is_503_within_the_timeout(tok, fake, stream):
    with make_client(tok, fake.address, verifier_timeout_s=1.0) as c:
        t0 = time.monotonic()
        r = c.post(COMPLETIONS, json={"prompt": "x", "stream": stream, "speculative": {"drafter": "stall"}})
        assert time.monotonic() - t0 < 5
        assert_error(r, 503, contains="no reply for 1 s")


def test_request_deadline_is_504(tok, fake):
    with make_client(tok, fake.address, request_timeout_s=1.0) as c:
        t0 = time.monotonic()
        r = c.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 50, "speculative": {"drafter": "slow"}})
        assert time.monotonic() - t0 < 5
        assert_error(r, 504, contains="DEADLINE_EXCEEDED")


def test_health_follows_the_verifiers_health_service(client, fake):
    fake.health.set("specd.v1.Verifier", health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        assert_error(client.get("/health"), 503, contains="NOT_SERVING")
    finally:
        fake.health.set("specd.v1.Verifier", health_pb2.HealthCheckResponse.SERVING)
    assert client.get("/health").status_code == 200


def test_a_prompt_far_over_the_context_is_refused_before_tokenizing(tok, fake):
    with make_client(tok, fake.address) as c:  # the default 4 MB body limit
        n = len(fake.requests)
        t0 = time.perf_counter()
        for body, endpoint in (({"prompt": "def f(x): return x\n" * 150_000}, COMPLETIONS),
                               ({"messages": [{"role": "user", "content": "word " * 600_000}]}, CHAT)):
            assert_error(c.post(endpoint, json=body), 400, contains="maximum context length")
        # Tokenizing 3 MB takes seconds; refusing it by its size takes nothing like that.
        assert time.perf_counter() - t0 < 1.5 and len(fake.requests) == n


def test_too_many_concurrent_requests_get_429(tok, fake, launcher):
    proc = launcher.start("gateway-limit", "gateway", ["--verifier", fake.address, "--max-concurrent-requests", "2",
                                                       "--log-level", "warning"], http=True)
    import httpx

    base = f"http://{proc.address}"
    body = {"prompt": "x", "max_tokens": 50, "stream": True, "speculative": {"drafter": "slow"}}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as a, \
            httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as b:
        assert a.status_code == b.status_code == 200
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert httpx.get(f"{base}/v1/models", timeout=30).status_code == 200  # only generations count
    assert wait_until(lambda: httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 1},
                                         timeout=30).status_code == 200)
    launcher.stop(proc)


def test_error_after_the_stream_started_is_an_sse_event(client):
    evs = events(client.post(CHAT, json={"messages": [{"role": "user", "content": "x"}], "stream": True,
                                         "speculative": {"drafter": "error-after:UNAVAILABLE"}}))
    assert evs[-1] == "[DONE]" and "went away" in evs[-2]["error"]["message"]
    assert evs[1]["choices"][0]["delta"]["content"]  # tokens before the failure were delivered


def test_verifier_down_gives_503_and_unhealthy(tok):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with make_client(tok, f"127.0.0.1:{port}", verifier_retry_s=1.0) as c:
        t0 = time.monotonic()  # tried, and tried again for a second: the verifier might have been restarting
        assert_error(c.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 2}), 503, contains="unavailable")
        assert 1.0 <= time.monotonic() - t0 < 10
        assert_error(c.get("/health"), 503)
        assert_error(c.post(COMPLETIONS, json={"prompt": "x", "top_p": 2}), 400, "top_p")  # validation still first


# ---------------------------------------------------------------- auth and admin


def test_api_key_guards_v1_only(tok, fake):
    with make_client(tok, fake.address, api_key="sk-1") as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-1"}):
            assert_error(c.post(COMPLETIONS, json={"prompt": "x"}, headers=headers), 401)
            assert_error(c.get("/v1/models", headers=headers), 401)
        ok = c.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 1}, headers={"Authorization": "Bearer sk-1"})
        assert ok.status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
        # No admin key configured: admin is off (fails closed), whatever the API key.
        for headers in ({}, {"Authorization": "Bearer sk-1"}):
            assert_error(c.get("/admin/drafters", headers=headers), 403, contains="--admin-key")
            assert_error(c.post("/admin/drafters", json={"name": "x", "address": "127.0.0.1:1"}, headers=headers), 403)
            assert_error(c.delete("/admin/drafters/ngram-1", headers=headers), 403)


def test_open_admin_serves_admin_without_a_key(tok, fake):
    with make_client(tok, fake.address, open_admin=True) as c:
        assert c.get("/admin/drafters").status_code == 200
    with pytest.raises(ValueError, match="--open-admin"):
        GatewayConfig(verifier=fake.address, admin_key="k", open_admin=True)


def test_post_bodies_must_be_json(tok, fake):
    """A cross-site form or text/plain POST (sent by browsers without a preflight) is refused
    before anything is read or done: no drafter registered, no generation."""
    auth = {"Authorization": "Bearer adm"}
    body = json.dumps({"name": "csrf", "address": "127.0.0.1:7002"})
    with make_client(tok, fake.address, admin_key="adm") as c:
        n = len(fake.requests)
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
            headers = {**auth, **({"content-type": ctype} if ctype else {})}
            assert_error(c.post("/admin/drafters", content=body, headers=headers), 415, contains="application/json")
            assert_error(c.post(COMPLETIONS, content=json.dumps({"prompt": "x"}), headers=headers), 415)
        assert len(fake.requests) == n
        ok = c.post(COMPLETIONS, content=json.dumps({"prompt": "x", "max_tokens": 1}),
                    headers={"content-type": "application/json; charset=utf-8"})
        assert ok.status_code == 200


def test_admin_proxy(tok, fake):
    auth = {"Authorization": "Bearer adm"}
    with make_client(tok, fake.address, admin_key="adm", api_key="sk-1") as c:
        assert_error(c.get("/admin/drafters"), 401)
        assert_error(c.get("/admin/drafters", headers={"Authorization": "Bearer sk-1"}), 401)
        (d,) = c.get("/admin/drafters", headers=auth).json()
        assert (d["name"], d["method"], d["healthy"], d["proposals"], d["acceptance_rate"]) == ("ngram-1", "ngram",
                                                                                               True, 10, 0.75)
        r = c.post("/admin/drafters", json={"name": "sfx", "address": "127.0.0.1:7002"}, headers=auth)
        assert r.status_code == 201 and r.json()["name"] == "sfx" and r.json()["address"] == "127.0.0.1:7002"
        assert_error(c.post("/admin/drafters", json={"name": "ngram-1", "address": "a:1"}, headers=auth), 409,
                     contains="already registered")
        assert_error(c.post("/admin/drafters", json={"name": "x", "address": "bad"}, headers=auth), 400,
                     contains="vocabulary")
        assert_error(c.post("/admin/drafters", json={"name": "x"}, headers=auth), 400, "address")
        assert_error(c.delete("/admin/drafters/nope", headers=auth), 404, contains="nope")
        r = c.delete("/admin/drafters/ngram-1", headers=auth)
        assert r.status_code == 200 and r.json()["deleted"] is True
        assert fake.removed[-1].name == "ngram-1" and fake.removed[-1].drain is True


# ---------------------------------------------------------------- the process


@pytest.fixture(scope="module")
def gateway_process(fake, launcher):
    """A real `specd gateway` process (uvicorn, uvloop) in front of the scripted verifier."""
    return launcher.start("gateway", "gateway", ["--verifier", fake.address, "--served-model-name", "demo",
                                                 "--log-level", "warning"], http=True)


def wait_until(cond, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_process_serves_the_openai_client(gateway_process):
    import openai

    base = f"http://{gateway_process.address}"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    assert [m.id for m in client.models.list()] == ["demo"]
    out = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}])
    assert out.choices[0].message.content == REPLY and out.usage.completion_tokens > 0
    stream = client.completions.create(model="demo", prompt="x", stream=True, stream_options={"include_usage": True})
    parts = list(stream)
    assert "".join(p.choices[0].text for p in parts if p.choices) == REPLY
    assert parts[-1].usage.model_extra["speculative"]["accepted_tokens"] == parts[-1].usage.completion_tokens


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels_the_generate_call(gateway_process, fake, stream):
    import httpx

    base = f"http://{gateway_process.address}"
    body = {"prompt": "x", "max_tokens": 50, "stream": stream, "speculative": {"drafter": "slow"}}
    before = set(fake.requests)
    if stream:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=10) as r:
            assert r.status_code == 200
            first = next(r.iter_lines())
            assert first.startswith("data: ")
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{base}/v1/completions", json=body, timeout=0.5)
    (rid,) = set(fake.requests) - before
    # Without the cancel the scripted verifier would stream for 20 s.
    assert wait_until(lambda: rid in fake.cancelled), "the Generate call was not cancelled"
    assert httpx.get(f"{base}/health").status_code == 200


def test_running_gauge_returns_to_zero_and_sigterm_stops_cleanly(gateway_process, launcher):
    import httpx

    url = f"http://{gateway_process.address}/metrics"
    assert wait_until(lambda: "specd_gateway_requests_running 0.0" in httpx.get(url).text)
    assert 'endpoint="/v1/completions",status="499"' in httpx.get(url).text  # the non-streamed disconnect
    launcher.stop(gateway_process)
    # uvicorn shuts down gracefully, then re-raises SIGTERM so the parent sees why it stopped;
    # a hang would have ended in SIGKILL.
    assert gateway_process.proc.returncode in (0, -signal.SIGTERM)
    assert "Traceback" not in gateway_process.log_text()


def test_startup_refuses_a_mismatched_tokenizer_and_a_missing_verifier(fake, specd_cli, cli_env):
    import subprocess

    fake.vocab_hash = "0" * 64
    try:
        r = subprocess.run([*specd_cli, "gateway", "--verifier", fake.address, "--port", "0"], env=cli_env,
                           capture_output=True, text=True, timeout=60)
    finally:
        fake.vocab_hash = fake.tok.vocab_hash()
    assert r.returncode == 1 and "does not match the verifier's model" in r.stderr, r.stderr
    t0 = time.monotonic()
    r = subprocess.run([*specd_cli, "gateway", "--verifier", "127.0.0.1:1", "--verifier-wait", "1"], env=cli_env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "did not answer within 1 s" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert time.monotonic() - t0 < 20


def test_gateway_never_imports_torch(cli_env):
    import subprocess
    import sys

    code = ("import sys, specd.gateway.main, specd.gateway.app; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], env=cli_env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
