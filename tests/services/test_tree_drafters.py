"""Token trees over the wire (issue 15): a `specd drafter` process drafting trees
(`--options '{"tree": ...}'`) and a verifier process that verifies them, over loopback gRPC.

Greedy output equals plain decoding, alone and in a batch, and the verifier really verified trees:
its Prometheus counters, parsed back, show more draft tokens per verify step than a chain of k
could carry.
"""
from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specd import auth
from specd.demo_paths import demo_model_dir
from specd.llm import LLM
from specd.sampling import SamplingParams
from specd.tokenizer import Tokenizer
from specd.v1 import verifier_pb2 as pb
from specd.v1 import verifier_pb2_grpc as pbg

pytestmark = pytest.mark.timeout(900)

SECRET = "tree-suite-secret"
TARGET, DRAFTER = demo_model_dir("target"), demo_model_dir("drafter")
SNIPPETS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n", "class Parser:\n    def __init__(self",
            "for i in range(10):\n    "]
K, TOKENS = 3, 40
TREE = {"branching": [3, 2, 1], "max_nodes": 16}


def _counter(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


@pytest.fixture(scope="module")
def stack(launcher):
    ports = {name: launcher.free_port() for name in ("tree", "verifier")}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(auth.TOKEN_ENV, SECRET)
        tree = launcher.start("drafter-tree", "drafter", [
            "--method", "draft_model", "--name", "tree", "--model", str(DRAFTER), "--dtype", "float32",
            "--options", json.dumps({"tree": TREE}), "--metrics-port", str(ports["tree"]), "--log-level", "warning"])
        verifier = launcher.start("verifier", "verifier", [
            "--model", str(TARGET), "--dtype", "float32", "--propose-timeout-ms", "2000",
            "--speculative-config", json.dumps({"adaptive": False}),  # drafts every step, however loaded
            "--drafter", f"tree={tree.address}", "--metrics-port", str(ports["verifier"]), "--log-level", "warning"])
    stub = pbg.VerifierStub(auth.sync_channel(verifier.address, auth.Security(secret=SECRET), auth.VERIFIER))
    deadline = time.monotonic() + 60
    while not [d.healthy for d in stub.ListDrafters(pb.ListDraftersRequest(), timeout=10).drafters] == [True]:
        assert time.monotonic() < deadline, "the tree drafter never became healthy"
        time.sleep(0.2)
    return dict(stub=stub, metrics=f"http://127.0.0.1:{ports['verifier']}/metrics")


def _greedy(stub, prompt: list[int]) -> list[int]:
    params = pb.SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, num_speculative_tokens=K,
                               drafter="tree")
    return [t for chunk in stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, params=params), timeout=300)
            for t in chunk.token_ids]


def test_trees_from_a_drafter_service_keep_greedy_output(stack):
    tok = Tokenizer.from_dir(TARGET)
    prompts = [tok.encode(s) for s in SNIPPETS]
    plain = LLM(str(TARGET), dtype="float32").generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True))
    reference = [o.token_ids for o in plain]
    for p, want in zip(prompts, reference):  # each alone
        assert _greedy(stack["stub"], p) == want
    with ThreadPoolExecutor(len(prompts)) as ex:  # and together
        assert list(ex.map(lambda p: _greedy(stack["stub"], p), prompts)) == reference
    steps = _counter(stack["metrics"], "specd_spec_decode_num_drafts_total")
    drafts = _counter(stack["metrics"], "specd_spec_decode_num_draft_tokens_total")
    accepted = _counter(stack["metrics"], "specd_spec_decode_num_accepted_tokens_total")
    assert steps > 0 and drafts > K * steps, (steps, drafts)  # trees: more nodes than a chain of k
    assert 0 < accepted <= K * steps
