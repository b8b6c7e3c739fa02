"""A parallel (PARD) draft model behind `specd drafter`: its Info says it drafts in one forward,
the verifier's pool reads that (the controller then prices a call as one step), and greedy
chat through the official client gives plain decoding's text with its drafts.

Real processes (conftest's launcher): the demo pair, the drafter given a `pard_token`."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from drafter_helpers import parallel_copy
from specd.models.demo_paths import demo_model_dir
from specd.models.tokenizer import vocab_hash_of
from specd.v1 import drafter_pb2 as dpb
from specd.v1 import drafter_pb2_grpc as dpbg

TARGET, DRAFTER = demo_model_dir("target"), demo_model_dir("drafter")
pytestmark = pytest.mark.skipif(not (DRAFTER / "config.json").is_file(), reason="the bundled demo pair is missing")
QUESTIONS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n", "class Parser:\n    def __init__(self"]


@pytest.fixture(scope="module")
def stack(launcher, tmp_path_factory):
    parallel = parallel_copy(DRAFTER, tmp_path_factory.mktemp("pard"), pard_token=3, parallel_drafts=3)
    pd = launcher.start("drafter-pd", "drafter", ["--method", "draft_model", "--name", "pd", "--model", parallel,
                                                  "--num-speculative-tokens", "3", "--log-level", "warning"])
    ng = launcher.start("drafter-ng", "drafter", ["--method", "ngram", "--name", "ng", "--log-level", "warning"])
    verifier = launcher.start("verifier", "verifier", ["--model", str(TARGET), "--drafter", f"pd={pd.address}",
                                                       "--log-level", "warning"])
    gateway = launcher.start("gateway", "gateway", ["--verifier", verifier.address, "--log-level", "warning"],
                             http=True)
    import openai

    client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="x", max_retries=0, timeout=120)
    return dict(pd=pd, ng=ng, client=client)


def test_info_and_the_pool_know_which_drafter_drafts_in_one_forward(stack):
    infos = {name: dpbg.DrafterStub(grpc.insecure_channel(stack[name].address)).Info(dpb.DrafterInfoRequest(),
                                                                                    timeout=30)
             for name in ("pd", "ng")}
    assert infos["pd"].one_forward and not infos["ng"].one_forward

    from services.verifier.drafter_pool import DrafterPool

    async def pool_view():
        pool = DrafterPool(infos["pd"].vocab_size, vocab_hash_of(TARGET))
        try:
            await pool.register("pd", stack["pd"].address)
            await pool.register("ng", stack["ng"].address)
            return pool.one_forward_of("pd"), pool.one_forward_of("ng")
        finally:
            await pool.close()

    assert asyncio.run(pool_view()) == (True, False)


def test_greedy_chat_with_parallel_drafts_is_plain_decoding(stack):
    client = stack["client"]
    drafted = 0
    for q in QUESTIONS:
        messages = [{"role": "user", "content": q}]
        plain = client.chat.completions.create(model="specd-demo-target", messages=messages, max_tokens=40,
                                               temperature=0, extra_body={"speculative": {"num_speculative_tokens": 0}})
        spec = client.chat.completions.create(model="specd-demo-target", messages=messages, max_tokens=40,
                                              temperature=0, extra_body={"speculative": {"num_speculative_tokens": 3}})
        assert spec.choices[0].message.content == plain.choices[0].message.content
        drafted += (spec.usage.model_extra or {}).get("speculative", {}).get("draft_tokens", 0)
    assert drafted > 0, "no drafts: the test would prove nothing"
