"""A lying drafter cannot bias sampled output (docs/architecture.md, "Services": trust and bounds; issue 14).

The drafter claims q(x) = 1e-6 for each of its drafts x, so a verifier that believed it would
accept x whenever p(x) > 1e-6. Registered untrusted (the default), its q is never read: its
drafts are verified as one-hot, which is exact whoever chose them. The check: every sampled
token after the first (each one drafted for, accepted or replaced by the verifier) is turned
into u = F(x-) + V·p(x) under the target's own distribution at its position (p from
transformers in float32, teacher-forced on the sequence; F the cumulative distribution over
token ids; V uniform). If every token follows the target given its prefix, the u are
independent uniforms (randomized probability integral transform), so a chi-square test of
their histogram against flat is a test against target-only sampling, position by position,
with ~10^5 samples. The same test fails when the liar is trusted: the test has power.
"""
from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from faulty_drafters import start_faulty
from target_distribution import chi2_uniform, pit_values

from specd.rpc import auth
from specd.models.demo_paths import demo_model_dir
from specd.models.tokenizer import Tokenizer
from specd.v1 import verifier_pb2 as pb
from specd.v1 import verifier_pb2_grpc as pbg

pytestmark = pytest.mark.timeout(1800)

SECRET = "hostile-suite-secret"
SECURITY = auth.Security(secret=SECRET)
TARGET = demo_model_dir("target")
# 400 x 259 = 103,600 drafted-for tokens, in one wave of short sequences: the forward's attention
# reads each sequence's whole context at every step, so 200 x 520 took twice the attention (and
# twice the steps) for the same samples (612 s of the suite's 43 min on the 2-core EPYC).
NUM_REQUESTS, MAX_TOKENS = 400, 260
SNIPPETS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n", "class Parser:\n    def __init__(self",
            "for i in range(10):\n    ", "    return self.", "with open(path) as f:\n    ",
            "try:\n    import json\nexcept ", "while True:\n    line = "]


@pytest.fixture(scope="module")
def verifier(launcher):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(auth.TOKEN_ENV, SECRET)
        return launcher.start("verifier", "verifier", [
            "--model", str(TARGET), "--dtype", "float32", "--max-num-seqs", str(NUM_REQUESTS),
            "--max-queued-requests", str(NUM_REQUESTS), "--propose-timeout-ms", "2000",
            "--speculative-config", json.dumps({"num_speculative_tokens": 4})])


@pytest.fixture(scope="module")
def stub(verifier):
    return pbg.VerifierStub(auth.sync_channel(verifier.address, SECURITY, auth.VERIFIER))


@pytest.fixture(scope="module")
def liars(stub):
    """Two lying drafters holding the secret: one registered untrusted, one trusted."""
    info = stub.Info(pb.InfoRequest(), timeout=30)
    servers = []
    for name, trusted in (("liar", False), ("liar-trusted", True)):
        server, servicer, address = start_faulty("lying_q", info.vocab_size, info.vocab_hash, secret=SECRET)
        servers.append((server, servicer))
        stub.RegisterDrafter(pb.RegisterDrafterRequest(name=name, address=address, trusted=trusted), timeout=30)
    yield
    for server, servicer in servers:
        servicer.stop.set()
        server.stop(0)


async def _generate_all(address: str, prompts: list[list[int]], drafter: str, max_tokens: int):
    """(output ids, final spec counters) per prompt. Unseeded: a seeded request is verified by the
    position walk, which reads no q at all (sampler.position_walk; tests/engine/test_speculative.py),
    and the rejection test, which does, is what a lying q could bias."""
    async with auth.aio_channel(address, SECURITY, auth.VERIFIER) as channel:
        stub = pbg.VerifierStub(channel)

        async def one(i: int, prompt: list[int]):
            params = pb.SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=1.0, ignore_eos=True,
                                       num_speculative_tokens=4, drafter=drafter)
            ids, last = [], None
            async for chunk in stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, params=params), timeout=1500):
                ids.extend(chunk.token_ids)
                last = chunk
            return ids, last.spec

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


@pytest.fixture(scope="module")
def prompts():
    tok = Tokenizer.from_dir(TARGET)
    return [tok.encode(s) for s in SNIPPETS]


def test_untrusted_liar_cannot_bias_sampled_output(verifier, liars, prompts):
    batch = [prompts[i % len(prompts)] for i in range(NUM_REQUESTS)]
    results = asyncio.run(_generate_all(verifier.address, batch, "liar", MAX_TOKENS))
    outputs = [ids for ids, _ in results]
    assert all(len(ids) == MAX_TOKENS for ids in outputs)
    drafted = sum(spec.draft_tokens for _, spec in results)
    accepted = sum(spec.accepted_tokens for _, spec in results)
    # The liar drafted for (nearly) every step and some drafts were right: both paths of the
    # acceptance test (accept, replace) are in the sample.
    assert drafted > NUM_REQUESTS * MAX_TOKENS and accepted > 1000, (drafted, accepted)
    u = pit_values(TARGET, batch, outputs)
    assert u.numel() >= 100_000
    stat, critical = chi2_uniform(u)
    print(f"untrusted liar: {u.numel()} samples, {drafted} drafted, {accepted} accepted, chi2 {stat:.1f} "
          f"(critical {critical:.1f})")
    assert stat < critical, f"chi2 {stat:.1f} >= {critical:.1f}: sampled output is not the target's"


def test_the_same_check_fails_when_the_liar_is_trusted(verifier, liars, prompts):
    batch = [prompts[i % len(prompts)] for i in range(16)]
    results = asyncio.run(_generate_all(verifier.address, batch, "liar-trusted", 64))
    accepted = sum(spec.accepted_tokens for _, spec in results)
    drafted = sum(spec.draft_tokens for _, spec in results)
    assert accepted > 0.9 * drafted, (accepted, drafted)  # believed: nearly every lie is accepted
    u = pit_values(TARGET, batch, [ids for ids, _ in results])
    stat, critical = chi2_uniform(u)
    print(f"trusted liar: {u.numel()} samples, {drafted} drafted, {accepted} accepted, chi2 {stat:.1f} "
          f"(critical {critical:.1f})")
    assert stat > critical, f"chi2 {stat:.1f} < {critical:.1f}: the check cannot see a trusted liar"


def test_trust_needs_the_drafter_to_prove_the_secret(stub):
    info = stub.Info(pb.InfoRequest(), timeout=30)
    for secret in (None, "another-secret"):
        server, servicer, address = start_faulty("lying_q", info.vocab_size, info.vocab_hash, secret=secret)
        try:
            with pytest.raises(grpc.RpcError) as e:
                stub.RegisterDrafter(pb.RegisterDrafterRequest(name="impostor", address=address, trusted=True),
                                     timeout=30)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "prove" in e.value.details()
            # Untrusted it may draft (and cost drafts at worst).
            reply = stub.RegisterDrafter(pb.RegisterDrafterRequest(name="impostor", address=address), timeout=30)
            assert reply.drafter.healthy and not reply.drafter.trusted
            stub.RemoveDrafter(pb.RemoveDrafterRequest(name="impostor"), timeout=30)
        finally:
            servicer.stop.set()
            server.stop(0)
