"""Pipelined drafting through real services (issue 16): a `specd drafter --pipeline` process
drafts ahead while the verifier process verifies, over loopback gRPC.

Greedy output equals plain decoding while drafts really come from the draft cache (the
verifier's and the drafter's Prometheus counters, parsed back, say so); sampled output at
T = 1 (a trusted drafter whose sparse q, drafted ahead, is used) passes the target-only
chi-square test, which the same stack fails at T = 0.8 (the test has power); a pipelined
drafter killed mid-stream costs drafts, never a request or a token.
"""
from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families
from target_distribution import chi2_uniform, pit_values

from specd.rpc import auth
from specd.models.demo_paths import demo_model_dir
from specd.sampling import SamplingParams
from specd.models.tokenizer import Tokenizer
from specd.v1 import verifier_pb2 as pb
from specd.v1 import verifier_pb2_grpc as pbg

pytestmark = pytest.mark.timeout(1200)

SECRET = "pipelined-suite-secret"
SECURITY = auth.Security(secret=SECRET)
TARGET, DRAFTER = demo_model_dir("target"), demo_model_dir("drafter")
SNIPPETS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n", "class Parser:\n    def __init__(self",
            "for i in range(10):\n    ", "    return self.", "with open(path) as f:\n    "]
GREEDY_TOKENS = 48
SAMPLED_REQUESTS, SAMPLED_TOKENS = 96, 200  # ~19,000 tokens drafted for


def _drafter_args(name: str, metrics_port: int) -> list[str]:
    return ["--method", "draft_model", "--name", name, "--model", str(DRAFTER), "--pipeline", "--dtype", "float32",
            "--options", json.dumps({"draft_sample_method": "sampled"}), "--metrics-port", str(metrics_port),
            "--log-level", "warning"]


@pytest.fixture(scope="module")
def stack(launcher):
    ports = {name: launcher.free_port() for name in ("pd", "verifier")}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(auth.TOKEN_ENV, SECRET)
        pd = launcher.start("drafter-pipelined", "drafter", _drafter_args("pd", ports["pd"]))
        verifier = launcher.start("verifier", "verifier", [
            "--model", str(TARGET), "--dtype", "float32", "--max-num-seqs", "128", "--propose-timeout-ms", "2000",
            "--trusted-drafter", f"pd={pd.address}", "--metrics-port", str(ports["verifier"]),
            "--log-level", "warning"])
    stub = pbg.VerifierStub(auth.sync_channel(verifier.address, SECURITY, auth.VERIFIER))
    _eventually(lambda: [d.healthy and d.trusted for d in stub.ListDrafters(pb.ListDraftersRequest(),
                                                                           timeout=10).drafters] == [True])
    urls = {name: f"http://127.0.0.1:{port}/metrics" for name, port in ports.items()}
    return dict(stub=stub, verifier=verifier, pd=pd, urls=urls, launcher=launcher)


def _eventually(cond, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def _status(stub) -> dict:
    return {d.name: d for d in stub.ListDrafters(pb.ListDraftersRequest(), timeout=10).drafters}


def _counter(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


@pytest.fixture(scope="module")
def prompts():
    tok = Tokenizer.from_dir(TARGET)
    return [tok.encode(s) for s in SNIPPETS]


@pytest.fixture(scope="module")
def plain():
    from specd.llm import LLM

    llm = LLM(str(TARGET), dtype="float32")
    return lambda prompts, n: [o.token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))]


@pytest.fixture(scope="module")
def reference(plain, prompts):
    return plain(prompts, GREEDY_TOKENS)


def _greedy(stub, prompt: list[int], drafter: str, max_tokens: int = GREEDY_TOKENS) -> list[int]:
    params = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, num_speculative_tokens=4,
                               drafter=drafter)
    return [t for chunk in stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, params=params), timeout=300)
            for t in chunk.token_ids]


def test_greedy_output_identical_with_pipelining(stack, prompts, reference):
    before = {n: _counter(stack["urls"][n], m) for n, m in (("verifier", "specd_spec_decode_num_cached_drafts_total"),
                                                            ("pd", "specd_drafter_draft_cache_hits_total"))}
    for p, want in zip(prompts, reference):  # batch 1: each request alone
        assert _greedy(stack["stub"], p, "pd") == want
    with ThreadPoolExecutor(len(prompts)) as ex:  # and all together
        assert list(ex.map(lambda p: _greedy(stack["stub"], p, "pd"), prompts)) == reference
    cached = _counter(stack["urls"]["verifier"], "specd_spec_decode_num_cached_drafts_total") - before["verifier"]
    hits = _counter(stack["urls"]["pd"], "specd_drafter_draft_cache_hits_total") - before["pd"]
    assert cached > 0 and hits >= cached, (cached, hits)  # drafts drafted ahead were verified
    assert _counter(stack["urls"]["pd"], "specd_drafter_predrafted_outcomes_total") > hits


async def _sample_all(address: str, prompts: list[list[int]], temperature: float):
    async with auth.aio_channel(address, SECURITY, auth.VERIFIER) as channel:
        stub = pbg.VerifierStub(channel)

        async def one(i: int, prompt: list[int]):
            # Unseeded: the rejection test reads the drafts' q (a seeded request's position walk does not).
            params = pb.SamplingParams(max_tokens=SAMPLED_TOKENS, temperature=temperature, top_p=1.0,
                                       ignore_eos=True, num_speculative_tokens=4, drafter="pd")
            ids = []
            async for chunk in stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, params=params), timeout=900):
                ids.extend(chunk.token_ids)
            return ids

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def test_sampled_output_is_the_targets_with_pipelining(stack, prompts):
    batch = [prompts[i % len(prompts)] for i in range(SAMPLED_REQUESTS)]
    cached_before = _counter(stack["urls"]["verifier"], "specd_spec_decode_num_cached_drafts_total")
    stats = {}
    for temperature in (1.0, 0.8):
        outputs = asyncio.run(_sample_all(stack["verifier"].address, batch, temperature))
        assert all(len(ids) == SAMPLED_TOKENS for ids in outputs)
        stats[temperature] = chi2_uniform(pit_values(TARGET, batch, outputs))
        if temperature == 1.0:
            cached = _counter(stack["urls"]["verifier"], "specd_spec_decode_num_cached_drafts_total") - cached_before
    print(f"pipelined sampling: {cached:.0f} steps verified drafts drafted ahead; chi2 (stat, critical) {stats}")
    assert cached > 100, "the sampled run hardly used drafted-ahead drafts: the test would not test them"
    assert stats[1.0][0] < stats[1.0][1], f"T=1: chi2 {stats[1.0]}: sampled output is not the target's"
    assert stats[0.8][0] > stats[0.8][1], f"T=0.8: chi2 {stats[0.8]}: the check cannot see a biased sampler"


def test_nothing_lost_when_a_pipelined_drafter_dies(stack, prompts, reference, plain):
    launcher, stub = stack["launcher"], stack["stub"]
    long = plain(prompts, 400)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(auth.TOKEN_ENV, SECRET)
        doomed = launcher.start("drafter-doomed", "drafter", _drafter_args("doomed", launcher.free_port()))
    stub.RegisterDrafter(pb.RegisterDrafterRequest(name="doomed", address=doomed.address), timeout=30)
    with ThreadPoolExecutor(len(prompts)) as ex:
        running = [ex.submit(_greedy, stub, p, "doomed", 400) for p in prompts]
        _eventually(lambda: _status(stub)["doomed"].proposals >= 20)  # mid-stream, drafting ahead
        doomed.proc.send_signal(signal.SIGKILL)
        results = [f.result() for f in running]
    assert results == long
    assert not _status(stub)["doomed"].healthy
    assert _greedy(stub, prompts[0], "pd") == reference[0]  # the pipelined one still serves
