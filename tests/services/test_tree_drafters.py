"""Token trees over the wire (issue 15): `specd drafter` processes drafting trees
(`--options '{"tree": ...}'`, and `--method combined`: draft_model + suffix merged into one
tree) and a verifier process that verifies them, over loopback gRPC.

Greedy output equals plain decoding, alone and in a batch, and the verifier really verified trees:
its Prometheus counters, parsed back, show more draft tokens per verify step than a chain of k
could carry. For the combined drafter, the suffix member's runs are accepted where the draft
model's chain could not reach: more accepted tokens per step than the draft model alone gets.
"""
from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specd.rpc import auth
from specd.models.demo_paths import demo_model_dir
from specd.llm import LLM
from specd.sampling import SamplingParams
from specd.models.tokenizer import Tokenizer
from specd.v1 import verifier_pb2 as pb
from specd.v1 import verifier_pb2_grpc as pbg

pytestmark = pytest.mark.timeout(900)

SECRET = "tree-suite-secret"
TARGET, DRAFTER = demo_model_dir("target"), demo_model_dir("drafter")
SNIPPETS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n", "class Parser:\n    def __init__(self",
            "for i in range(10):\n    "]
K, TOKENS = 3, 40
TREE = {"branching": [3, 2, 1], "max_nodes": 16}


def _counter(url: str, name: str, drafter: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and s.labels.get("drafter") == drafter)


@pytest.fixture(scope="module")
def stack(launcher):
    ports = {name: launcher.free_port() for name in ("tree", "combined", "chain", "verifier")}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(auth.TOKEN_ENV, SECRET)
        tree = launcher.start("drafter-tree", "drafter", [
            "--method", "draft_model", "--name", "tree", "--model", str(DRAFTER), "--dtype", "float32",
            "--options", json.dumps({"tree": TREE}), "--metrics-port", str(ports["tree"]), "--log-level", "warning"])
        combined = launcher.start("drafter-combined", "drafter", [
            "--method", "combined", "--name", "combined", "--dtype", "float32", "--metrics-port",
            str(ports["combined"]), "--log-level", "warning", "--options", json.dumps(
                {"members": [{"method": "draft_model", "model": str(DRAFTER)}, {"method": "suffix"}]})])
        chain = launcher.start("drafter-chain", "drafter", [
            "--method", "draft_model", "--name", "chain", "--model", str(DRAFTER), "--dtype", "float32",
            "--metrics-port", str(ports["chain"]), "--log-level", "warning"])
        verifier = launcher.start("verifier", "verifier", [
            "--model", str(TARGET), "--dtype", "float32", "--propose-timeout-ms", "2000",
            "--speculative-config", json.dumps({"adaptive": False}),  # drafts every step, however loaded
            "--drafter", f"tree={tree.address}", "--drafter", f"combined={combined.address}",
            "--drafter", f"chain={chain.address}", "--metrics-port", str(ports["verifier"]), "--log-level", "warning"])
    stub = pbg.VerifierStub(auth.sync_channel(verifier.address, auth.Security(secret=SECRET), auth.VERIFIER))
    deadline = time.monotonic() + 60
    while not [d.healthy for d in stub.ListDrafters(pb.ListDraftersRequest(), timeout=10).drafters] == [True] * 3:
        assert time.monotonic() < deadline, "the drafters never became healthy"
        time.sleep(0.2)
    return dict(stub=stub, metrics=f"http://127.0.0.1:{ports['verifier']}/metrics")


def _greedy(stub, prompt: list[int], drafter: str) -> list[int]:
    params = pb.SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, num_speculative_tokens=K,
                               drafter=drafter)
    return [t for chunk in stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, params=params), timeout=300)
            for t in chunk.token_ids]


@pytest.fixture(scope="module")
def reference() -> tuple[list[list[int]], list[list[int]]]:
    tok = Tokenizer.from_dir(TARGET)
    prompts = [tok.encode(s) for s in SNIPPETS]
    plain = LLM(str(TARGET), dtype="float32").generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True))
    return prompts, [o.token_ids for o in plain]


def _check_greedy(stub, reference, drafter: str) -> None:
    prompts, want = reference
    for p, w in zip(prompts, want):  # each alone
        assert _greedy(stub, p, drafter) == w
    with ThreadPoolExecutor(len(prompts)) as ex:  # and together
        assert list(ex.map(lambda p: _greedy(stub, p, drafter), prompts)) == want


def _spec_counters(metrics: str, drafter: str) -> tuple[float, float, float]:
    """(verify steps with drafts, draft tokens, accepted tokens) of one drafter."""
    return tuple(_counter(metrics, f"specd_spec_decode_num_{n}_total", drafter)
                 for n in ("drafts", "draft_tokens", "accepted_tokens"))


def test_trees_from_a_drafter_service_keep_greedy_output(stack, reference):
    _check_greedy(stack["stub"], reference, "tree")
    steps, drafts, accepted = _spec_counters(stack["metrics"], "tree")
    assert steps > 0 and drafts > K * steps, (steps, drafts)  # trees: more nodes than a chain of k
    assert 0 < accepted <= K * steps


def test_combined_drafter_merges_draft_model_and_suffix(stack, reference):
    # The code snippets repeat themselves under the demo target: suffix finds those runs.
    _check_greedy(stack["stub"], reference, "combined")
    _check_greedy(stack["stub"], reference, "chain")
    steps, drafts, accepted = _spec_counters(stack["metrics"], "combined")
    assert steps > 0 and drafts > K * steps, (steps, drafts)  # merged trees: more nodes than one chain
    chain_steps, _, chain_accepted = _spec_counters(stack["metrics"], "chain")
    assert accepted / steps > chain_accepted / chain_steps, (accepted, steps, chain_accepted, chain_steps)
