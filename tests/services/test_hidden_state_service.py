"""Hidden-state drafters as services: `specd drafter --method eagle|eagle3` processes next to a
real verifier process, over loopback gRPC.

Both heads (random weights in the published yuhuili layouts, written for the demo target)
register at one verifier, which captures the union of their layers. Greedy output over the
verifier's Generate RPC equals plain decoding for requests routed to each, the heads really
draft (their features arrive in the right shape, or they would only ever ask for resync), and
a head built for another target is refused at registration with a clear error.
"""
from __future__ import annotations

import socket
import time
import urllib.request

import grpc
import pytest
import torch
from head_layouts import write_layout

from specd.models.demo_paths import demo_model_dir
from specd.sampling import SamplingParams
from specd.models.tokenizer import Tokenizer
from specd.v1 import verifier_pb2 as pb
from specd.v1 import verifier_pb2_grpc as pbg
from specd.rpc.wire import params_to_proto

transformers = pytest.importorskip("transformers")
TARGET = str(demo_model_dir("target"))
SNIPPETS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n", "class Parser:\n    def __init__(self",
            "for i in range(10):\n    "]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    model = transformers.AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("heads")
    return {name: str(write_layout(name, root / name, model)[1]) for name in ("eagle", "eagle3")}


@pytest.fixture(scope="module")
def prompts():
    tok = Tokenizer.from_dir(TARGET)
    return [tok.encode(s) for s in SNIPPETS]


@pytest.fixture(scope="module")
def plain(prompts):
    from specd.llm import LLM

    llm = LLM(TARGET, dtype="float32")
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                                       ignore_eos=True))]


def generate(stub, prompt, drafter: str) -> list[int]:
    params = params_to_proto(SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                            num_speculative_tokens=3), drafter=drafter)
    out = []
    for chunk in stub.Generate(pb.GenerateRequest(request_id=f"r{drafter}{len(out)}{prompt[:3]}",
                                                  prompt_token_ids=prompt, params=params), timeout=120):
        out += chunk.token_ids
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def feature_bytes(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {s.labels["drafter"]: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "specd_verifier_propose_feature_bytes_total"}


def test_eagle_and_eagle3_drafter_services_keep_greedy_output(launcher, heads, prompts, plain, tmp_path):
    e1 = launcher.start("drafter-eagle", "drafter", ["--method", "eagle", "--name", "e1", "--model", heads["eagle"],
                                                     "--target", TARGET, "--dtype", "float32"])
    e3 = launcher.start("drafter-eagle3", "drafter", ["--method", "eagle3", "--name", "e3", "--model",
                                                      heads["eagle3"], "--target", TARGET, "--dtype", "float32"])
    metrics_port = free_port()
    verifier = launcher.start("verifier", "verifier", ["--model", TARGET, "--dtype", "float32", "--drafter",
                                                       f"e1={e1.address}", "--drafter", f"e3={e3.address}",
                                                       "--propose-timeout-ms", "5000",
                                                       "--metrics-port", str(metrics_port)])
    stub = pbg.VerifierStub(grpc.insecure_channel(verifier.address))
    for _ in range(300):
        listed = {d.name: d for d in stub.ListDrafters(pb.ListDraftersRequest(), timeout=10).drafters}
        if len(listed) == 2 and all(d.healthy for d in listed.values()):
            break
        time.sleep(0.2)
    assert {n: d.method for n, d in listed.items()} == {"e1": "eagle", "e3": "eagle3"}

    for name in ("e1", "e3"):
        got = [generate(stub, p, name) for p in prompts]
        assert got == plain, f"greedy output with {name} differs from plain decoding"
    listed = {d.name: d for d in stub.ListDrafters(pb.ListDraftersRequest(), timeout=10).drafters}
    for name in ("e1", "e3"):
        assert listed[name].draft_tokens > 0, f"{name} never drafted: {listed[name]}"
        assert listed[name].healthy and listed[name].violations == 0

    # The feature bytes each drafter was sent, from the verifier's Prometheus exposition: every
    # committed token's row once (float32, one hidden-size row per layer), three layers for EAGLE-3.
    sent = feature_bytes(metrics_port)
    row = 4 * transformers.AutoConfig.from_pretrained(TARGET).hidden_size
    assert sent["e1"] % row == 0 and sum(len(p) - 1 for p in prompts) <= sent["e1"] // row <= sum(
        len(p) + MAX_TOKENS for p in prompts), sent
    assert sent["e3"] == 3 * sent["e1"], sent

    # A head written for another target (hidden size 32, 8 layers) is refused by name.
    other = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=Tokenizer.from_dir(TARGET).vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2)).eval()
    other_dir = tmp_path / "other-target"
    other.save_pretrained(other_dir)
    wrong_head = str(write_layout("eagle", tmp_path / "wrong-head", other)[1])
    wrong = launcher.start("drafter-wrong", "drafter", ["--method", "eagle", "--name", "wrong", "--model", wrong_head,
                                                        "--target", str(other_dir)])
    with pytest.raises(grpc.RpcError) as err:
        stub.RegisterDrafter(pb.RegisterDrafterRequest(name="wrong", address=wrong.address), timeout=30)
    assert "hidden size" in err.value.details()


def test_a_conversations_next_turn_sends_the_head_only_the_rows_it_lacks(launcher, heads, prompts):
    """Turn 2 of a conversation resends turn 1: the verifier serves it from its prefix cache and
    the EAGLE head from its own (it kept turn 1's KV when the request ended), so the rows sent for
    turn 2 start where both caches end instead of at the first token; tokens equal plain bf16."""
    from specd.llm import LLM

    e1 = launcher.start("drafter-eagle-pc", "drafter", ["--method", "eagle", "--name", "e1", "--model", heads["eagle"],
                                                        "--target", TARGET, "--dtype", "bfloat16"])
    metrics_port = free_port()
    verifier = launcher.start("verifier-pc", "verifier", ["--model", TARGET, "--dtype", "bfloat16", "--drafter",
                                                          f"e1={e1.address}", "--propose-timeout-ms", "5000",
                                                          "--metrics-port", str(metrics_port)])
    stub = pbg.VerifierStub(grpc.insecure_channel(verifier.address))
    for _ in range(300):
        if any(d.healthy for d in stub.ListDrafters(pb.ListDraftersRequest(), timeout=10).drafters):
            break
        time.sleep(0.2)
    first = sum(prompts, []) * 2  # ~80 tokens of code
    answer = generate(stub, first, "e1")
    second = first + answer + prompts[0]
    before = feature_bytes(metrics_port)["e1"]
    got = generate(stub, second, "e1")
    sent_rows = (feature_bytes(metrics_port)["e1"] - before) // (2 * transformers.AutoConfig.from_pretrained(
        TARGET).hidden_size)
    llm = LLM(TARGET, dtype="bfloat16")
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert [answer, got] == [o.token_ids for o in llm.generate([first, second], greedy)]
    # The verifier holds turn 1's whole 16-token blocks of KV (c tokens; its last token was never
    # fed); a 16-pair block of the head reads one token more, so rows start at 16 * ((c - 1) // 16).
    cached = 16 * ((len(first) + len(answer) - 1) // 16)
    start = 16 * ((cached - 1) // 16)
    assert start >= 64 and sent_rows <= len(second) - 1 - start + MAX_TOKENS, (sent_rows, len(second), start)
    listed = {d.name: d for d in stub.ListDrafters(pb.ListDraftersRequest(), timeout=10).drafters}
    assert listed["e1"].draft_tokens > 0
