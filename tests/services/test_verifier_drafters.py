"""The stack as users see it — drafters, verifier and gateway as real processes on loopback,
driven through the official `openai` client: greedy output never changes, whatever the
drafters do (die, hang, talk garbage, get swapped under load). Administration goes over
the verifier's gRPC admin API."""
from __future__ import annotations

import json
import shutil
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest
from faulty_drafters import GARBAGE_MODES, HOSTILE_MODES, start_faulty
from prometheus_client.parser import text_string_to_metric_families

from specd.models.demo_paths import demo_model_dir
from specd.sampling import SamplingParams
from specd.models.tokenizer import Tokenizer
from specd.v1 import verifier_pb2 as pb
from specd.v1 import verifier_pb2_grpc as pbg
from specd.rpc.wire import params_to_proto

MAX_TOKENS = 48
MODEL = "specd-demo-target"
TARGET_DIR, DRAFTER_DIR = str(demo_model_dir("target")), str(demo_model_dir("drafter"))
SNIPPETS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n", "class Parser:\n    def __init__(self",
            "for i in range(10):\n    ", "    return self.", "def main():\n    args = ", "if __name__ == ",
            "with open(path) as f:\n    ", "try:\n    import json\nexcept ", "    def __repr__(self):\n        ",
            "x = [i * i for i in ", "raise ValueError(", "@property\ndef name(self):\n    ", "# Copyright",
            "while True:\n    line = ", "from collections import "]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(demo_model_dir("target"))


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.encode(s) for s in SNIPPETS]


@pytest.fixture(scope="module")
def reference(prompts):
    """Greedy tokens of the target alone, from the offline engine (itself checked against transformers)."""
    from specd.llm import LLM

    llm = LLM(str(demo_model_dir("target")))
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return [o.text for o in outs]


@pytest.fixture(scope="module")
def stack(launcher):
    """Two drafters (draft_model, ngram), a verifier with a metrics port, and the gateway."""
    dm = launcher.start("drafter-dm", "drafter", ["--method", "draft_model", "--name", "dm", "--model", DRAFTER_DIR])
    ng = launcher.start("drafter-ng", "drafter", ["--method", "ngram", "--name", "ng"])
    metrics_port = launcher.free_port()
    verifier = launcher.start("verifier", "verifier", ["--model", TARGET_DIR, "--drafter", f"dm={dm.address}",
                                                       "--drafter", f"ng={ng.address}", "--metrics-port",
                                                       str(metrics_port)])
    gateway = launcher.start("gateway", "gateway", ["--verifier", verifier.address], http=True)
    stub = pbg.VerifierStub(grpc.insecure_channel(verifier.address))
    _wait(lambda: all(d.healthy for d in _drafters(stub).values()) and len(_drafters(stub)) == 2)
    client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="x", max_retries=0, timeout=120)
    return dict(launcher=launcher, dm=dm, ng=ng, verifier=verifier, stub=stub, metrics_port=metrics_port,
                client=client, gateway=gateway)


def _wait(cond, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _drafters(stub) -> dict:
    return {d.name: d for d in stub.ListDrafters(pb.ListDraftersRequest(), timeout=10).drafters}


def generate(client, prompt, k=None, drafter="", max_tokens=MAX_TOKENS):
    """One streamed greedy completion: (text, finish_reason, usage.speculative)."""
    spec = {key: v for key, v in (("num_speculative_tokens", k), ("drafter", drafter)) if v not in (None, "")}
    text, finish, usage = "", None, None
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"speculative": spec} if spec else None):
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    return text, finish, usage.model_extra["speculative"]


def generate_all(client, prompts, **kw):
    with ThreadPoolExecutor(len(prompts)) as ex:
        return list(ex.map(lambda p: generate(client, p, **kw), prompts))


def test_greedy_identical_with_each_drafter_and_without(stack, prompts, reference):
    # {}: the controller's choice, which on this shared CPU may rightly be k = 0; the named
    # drafters get a fixed k so each of them is certainly exercised.
    for kw in ({}, {"drafter": "dm", "k": 4}, {"drafter": "ng", "k": 4}, {"k": 0}):
        results = generate_all(stack["client"], prompts, **kw)
        assert [text for text, _, _ in results] == reference, kw
        assert all(finish in ("stop", "length") for _, finish, _ in results)
        drafts = sum(spec["draft_tokens"] for _, _, spec in results)
        if kw.get("k") == 0:
            assert drafts == 0
        elif kw:
            assert drafts > 0, f"no speculation happened with {kw}"
            accepted = sum(spec["accepted_tokens"] for _, _, spec in results)
            assert 0 < accepted <= drafts
        for _, _, spec in results:  # per request: who drafted, and acceptance per position
            assert sum(spec["drafters"].values()) == spec["drafts"]
            assert set(spec["drafters"]) <= ({kw["drafter"]} if "drafter" in kw else {"dm", "ng"})
            assert sum(spec["accepted_per_pos"]) == spec["accepted_tokens"]
            assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["accepted_tokens"] / max(spec["drafts"], 1))


def test_unknown_drafter_and_bad_params_are_client_errors(stack, prompts):
    with pytest.raises(openai.BadRequestError) as e:
        generate(stack["client"], prompts[0], drafter="nope")
    assert "unknown drafter 'nope'" in str(e.value)
    stub = stack["stub"]  # the verifier's own contract: INVALID_ARGUMENT with the reason
    bad = pb.GenerateRequest(prompt_token_ids=prompts[0], params=pb.SamplingParams(max_tokens=0, top_p=1))
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(bad, timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(prompt_token_ids=[5000], params=params_to_proto(SamplingParams())),
                           timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside the vocabulary" in e.value.details()


def test_drafter_sigkill_mid_stream_then_restart(stack, prompts, reference):
    stub, client, launcher, dm = stack["stub"], stack["client"], stack["launcher"], stack["dm"]
    with ThreadPoolExecutor(8) as ex:
        running = [ex.submit(generate, client, p, drafter="dm") for p in prompts[:8]]
        time.sleep(0.3)
        dm.proc.send_signal(signal.SIGKILL)
        results = [f.result() for f in running]
    assert [text for text, _, _ in results] == reference[:8]
    _wait(lambda: not _drafters(stub)["dm"].healthy, what="dm unhealthy")
    assert _drafters(stub)["dm"].state == "unhealthy"
    # Requests keep working meanwhile (on the other drafter or none).
    assert generate(client, prompts[8])[0] == reference[8]
    restarted = launcher.start("drafter-dm-restarted", "drafter", dm.argv[dm.argv.index("--method"):],
                               port=int(dm.address.rsplit(":", 1)[1]))
    stack["dm"] = restarted
    _wait(lambda: _drafters(stub)["dm"].healthy, timeout=30, what="dm healthy again")
    text, _, spec = generate(client, prompts[9], drafter="dm", k=4)  # k fixed: the drafter must be asked
    assert text == reference[9] and spec["draft_tokens"] > 0


@pytest.mark.parametrize("mode", [*GARBAGE_MODES, *HOSTILE_MODES, "hang"])
def test_misbehaving_drafter_never_corrupts_output(stack, prompts, reference, mode):
    stub = stack["stub"]
    info = stub.Info(pb.InfoRequest())
    server, servicer, address = start_faulty(mode, info.vocab_size, info.vocab_hash)
    try:
        stub.RegisterDrafter(pb.RegisterDrafterRequest(name=mode, address=address), timeout=10)
        # k fixed per request: the controller would otherwise stop drafting once a hang makes
        # drafting look expensive, and this test is about the pool's handling of the drafter.
        results = generate_all(stack["client"], prompts[:4], drafter=mode, k=4)
        assert [text for text, _, _ in results] == reference[:4]
        assert servicer.batches > 1, "the faulty drafter was never asked"
        if mode == "hang":  # its first history goes in the background (no step waits); out of rotation
            # once that round trip's deadline passes (it answers probes, so it flaps)
            _wait(lambda: _drafters(stub)[mode].timeouts >= 1, what="the hanging drafter's missed deadline")
            assert "deadline" in _drafters(stub)[mode].last_error
        elif mode in ("random_ids", "lying_q", "bad_q", "q_length"):  # ids in range: verified as one-hot
            assert sum(spec["draft_tokens"] for _, _, spec in results) > 0  # (an untrusted drafter's q is unread)
        elif mode not in ("huge", "oversized", "flood"):  # malformed drafts are dropped before verification
            # (huge: only its first proposal is; oversized and flood break the stream, and while the
            # drafter is out of rotation its requests draft with another one)
            assert sum(spec["draft_tokens"] for _, _, spec in results) == 0
        status = _drafters(stub)[mode]
        assert not status.trusted
        if mode in ("too_many", "wrong_seq_ids", "huge", "flood"):  # out of the protocol's bounds: counted
            # when the reply is read: a huge one may go in the background and land after the requests end
            _wait(lambda: _drafters(stub)[mode].violations > 0, timeout=10, what=f"{mode}'s violation counted")
        if mode == "flood":  # unsolicited replies break the stream: out of rotation
            _wait(lambda: "unsolicited" in _drafters(stub)[mode].last_error, timeout=10, what="the flood's error")
        if mode == "oversized":  # over the reply size bound: the stream breaks
            # Under load a missed deadline may take the drafter out first and the requests end before
            # it is back (a stream already broken keeps its first error): then it is asked again.
            def broke_on_size() -> bool:
                status = _drafters(stub)[mode]
                if any(s in status.last_error for s in ("RESOURCE_EXHAUSTED", "larger than max")):
                    return True
                if status.healthy:
                    assert generate(stack["client"], prompts[0], drafter=mode, k=4)[0] == reference[0]
                return False

            _wait(broke_on_size, timeout=30, what="the oversized reply's error")
    finally:
        stub.RemoveDrafter(pb.RemoveDrafterRequest(name=mode, drain=False), timeout=10)
        servicer.stop.set()
        server.stop(0)


def test_drafter_reading_a_new_history_holds_no_step(stack, prompts):
    """A drafter that needs longer than the propose deadline to read a new sequence's history (a
    model drafter computing several prompts on a busy core) is not waited for: the history goes to
    it in the background, the sequence drafts from it once it has caught up, it misses no deadline
    and stays in rotation, and the output is plain decoding's."""
    stub = stack["stub"]
    info = stub.Info(pb.InfoRequest())
    server, servicer, address = start_faulty("slow_catch_up", info.vocab_size, info.vocab_hash)
    try:
        stub.RegisterDrafter(pb.RegisterDrafterRequest(name="slow", address=address), timeout=10)
        plain = generate_all(stack["client"], prompts[:2], k=0, max_tokens=400)
        drafted = generate_all(stack["client"], prompts[:2], drafter="slow", k=4, max_tokens=400)
        assert [text for text, _, _ in drafted] == [text for text, _, _ in plain]
        assert servicer.catch_ups >= 1, "the drafter never read a new history"
        status = _drafters(stub)["slow"]
        assert status.timeouts == 0 and status.healthy, status
        assert sum(spec["draft_tokens"] for _, _, spec in drafted) > 0, "no drafts once it had caught up"
    finally:
        stub.RemoveDrafter(pb.RemoveDrafterRequest(name="slow", drain=False), timeout=10)
        servicer.stop.set()
        server.stop(0)


def test_runtime_swap_under_load(stack, prompts, reference):
    stub, launcher = stack["stub"], stack["launcher"]
    extra = launcher.start("drafter-dm2", "drafter", ["--method", "draft_model", "--name", "dm2", "--model",
                                                      DRAFTER_DIR])
    errors = []

    def swap():
        try:
            time.sleep(0.2)
            stub.RegisterDrafter(pb.RegisterDrafterRequest(name="dm2", address=extra.address), timeout=30)
            time.sleep(0.2)
            stub.RemoveDrafter(pb.RemoveDrafterRequest(name="dm", drain=True), timeout=30)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    swapper = threading.Thread(target=swap)
    swapper.start()
    results = generate_all(stack["client"], prompts)  # 16 streams, default routing
    swapper.join()
    assert not errors
    assert [text for text, _, _ in results] == reference
    assert set(_drafters(stub)) == {"ng", "dm2"}
    # put the pool back as the other tests expect it
    stub.RegisterDrafter(pb.RegisterDrafterRequest(name="dm", address=stack["dm"].address), timeout=30)


def test_vocabulary_mismatch_refused(stack, tmp_path, model_dirs):
    stub, launcher = stack["stub"], stack["launcher"]
    # Same size, different token<->id table: two tokens swap ids.
    other = tmp_path / "swapped-vocab"
    shutil.copytree(demo_model_dir("drafter"), other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    for name, model in (("swapped", other), ("tiny", model_dirs["llama"])):
        d = launcher.start(f"drafter-{name}", "drafter", ["--method", "draft_model", "--model", str(model)])
        with pytest.raises(grpc.RpcError) as e:
            stub.RegisterDrafter(pb.RegisterDrafterRequest(name=name, address=d.address), timeout=30)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "tokenizer" in e.value.details() and name not in _drafters(stub)
        launcher.stop(d)


def test_client_disconnect_frees_kv_blocks(stack, prompts):
    port = stack["metrics_port"]

    def kv_used():
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        for family in text_string_to_metric_families(text):
            if family.name == "specd_verifier_kv_blocks_used":
                return family.samples[0].value
        raise AssertionError("no specd_verifier_kv_blocks_used gauge")

    _wait(lambda: kv_used() == 0, what="idle verifier")
    body = {"model": MODEL, "prompt": prompts[0], "max_tokens": 900, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"http://{stack['gateway'].address}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert kv_used() > 0
    # leaving the block closed the connection mid-stream
    _wait(lambda: kv_used() == 0, timeout=10, what="KV freed after the client went away")
