"""The services' Prometheus metrics agree with what clients were told.

Real processes (conftest's launcher): two drafters and a verifier with metrics ports, a
gateway; requests through the official `openai` client, some with speculation off. Every
service's /metrics is parsed with prometheus_client's parser and compared, as deltas, with
the usage the responses reported.
"""
from __future__ import annotations

import time
import urllib.request
from collections import defaultdict

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specd.models.demo_paths import demo_model_dir
from specd.v1 import verifier_pb2 as pb
from specd.v1 import verifier_pb2_grpc as pbg

MODEL = "specd-demo-target"
MODEL_DIR = demo_model_dir("target")
pytestmark = pytest.mark.skipif(not (MODEL_DIR / "config.json").is_file(), reason="the bundled demo target is missing")

PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n", "for i in range(10):\n    ",
           "class Parser:\n    def __init__(self"]
SPEC_OFF = {"speculative": {"num_speculative_tokens": 0}}


@pytest.fixture(scope="module")
def stack(launcher):
    ports = {name: launcher.free_port() for name in ("dm", "ng", "verifier")}
    dm = launcher.start("drafter-dm", "drafter", ["--method", "draft_model", "--name", "dm",
                                                  "--model", str(demo_model_dir("drafter")),
                                                  "--metrics-port", str(ports["dm"]), "--lazy-kv-cache",
                                                  "--log-level", "warning"])
    ng = launcher.start("drafter-ng", "drafter", ["--method", "ngram", "--name", "ng",
                                                  "--metrics-port", str(ports["ng"]), "--log-level", "warning"])
    verifier = launcher.start("verifier", "verifier", ["--model", str(MODEL_DIR), "--drafter", f"dm={dm.address}",
                                                       "--drafter", f"ng={ng.address}",
                                                       "--metrics-port", str(ports["verifier"]),
                                                       "--log-level", "warning"])
    gateway = launcher.start("gateway", "gateway", ["--verifier", verifier.address, "--log-level", "warning"],
                             http=True)
    stub = pbg.VerifierStub(grpc.insecure_channel(verifier.address))
    _eventually(lambda: {d.name for d in stub.ListDrafters(pb.ListDraftersRequest(), timeout=10).drafters
                         if d.healthy} == {"dm", "ng"}, what="both drafters healthy")
    import openai

    client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="x", max_retries=0, timeout=120)
    urls = {"gateway": f"http://{gateway.address}/metrics",
            **{name: f"http://127.0.0.1:{port}/metrics" for name, port in ports.items()}}
    return dict(client=client, urls=urls, launcher=launcher, ng=ng, stub=stub)


def _eventually(cond, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


class Scrape:
    """One /metrics page: sample values by (sample name, labels)."""

    def __init__(self, url: str):
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.values: dict[tuple, float] = {}
        for family in self.families.values():
            for s in family.samples:
                self.values[(s.name, tuple(sorted(s.labels.items())))] = s.value

    def get(self, name: str, **labels) -> float:
        """Sum of the samples called name whose labels include the given ones (0 when none)."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.values.items() if n == name and want <= set(ls))

    def by(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for (n, ls), v in self.values.items():
            if n == name:
                out[dict(ls)[label]] += v
        return dict(out)


def scrape(stack) -> dict[str, Scrape]:
    return {name: Scrape(url) for name, url in stack["urls"].items()}


SPEC = ("specd_spec_decode_num_drafts_total", "specd_spec_decode_num_draft_tokens_total",
        "specd_spec_decode_num_accepted_tokens_total")
USAGE_KEYS = ("drafts", "draft_tokens", "accepted_tokens")


def _spec_counters(v: Scrape) -> dict[str, float]:
    return {name: v.get(name) for name in (*SPEC, "specd_spec_decode_num_accepted_tokens_per_pos_total")}


def _complete(client, i: int, *, chat: bool, stream: bool, extra: dict | None):
    """One request; returns its usage (prompt/completion tokens and the speculative counters)."""
    kw = dict(model=MODEL, max_tokens=24, temperature=0, extra_body=extra)
    if chat:
        kw["messages"] = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
        create = client.chat.completions.create
    else:
        kw["prompt"] = PROMPTS[i % len(PROMPTS)]
        create = client.completions.create
    if not stream:
        return create(**kw).usage
    chunks = list(create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None
    return chunks[-1].usage


def test_speculation_off_adds_nothing_to_the_speculation_counters(stack):
    client = stack["client"]
    _complete(client, 0, chat=False, stream=False, extra=None)  # something to count first
    before = _spec_counters(scrape(stack)["verifier"])
    for i, (chat, stream) in enumerate([(False, False), (True, True)]):
        usage = _complete(client, i, chat=chat, stream=stream, extra=SPEC_OFF)
        assert usage.model_extra["speculative"] == {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0,
                                                    "accepted_per_pos": [], "mean_acceptance_length": 1.0,
                                                    "drafters": {}}
        assert usage.completion_tokens > 0
    assert _spec_counters(scrape(stack)["verifier"]) == before


def test_counters_agree_with_the_usage_the_clients_saw(stack):
    client = stack["client"]
    before = scrape(stack)
    # (chat, stream, speculative settings); every speculating request names its drafter,
    # so the per-drafter series can be checked too
    calls = [(False, False, {"speculative": {"drafter": "dm"}}),
             (True, False, {"speculative": {"drafter": "dm", "num_speculative_tokens": 3}}),
             (False, True, {"speculative": {"drafter": "ng", "num_speculative_tokens": 4}}),
             (True, True, {"speculative": {"drafter": "ng"}}),
             (False, False, SPEC_OFF),
             (True, True, {"speculative": {"drafter": "dm", "num_speculative_tokens": 2}})]
    usages = [_complete(client, i, chat=chat, stream=stream, extra=extra)
              for i, (chat, stream, extra) in enumerate(calls)]
    n_chat, n_text = sum(c[0] for c in calls), sum(not c[0] for c in calls)

    expected = {name: defaultdict(int) for name in USAGE_KEYS}  # usage key -> drafter -> sum
    for (_, _, extra), usage in zip(calls, usages):
        drafter = extra["speculative"].get("drafter", "")
        for key in USAGE_KEYS:
            expected[key][drafter] += usage.model_extra["speculative"][key]
    assert expected["draft_tokens"]["dm"] > 0 and expected["draft_tokens"]["ng"] > 0, "no speculation happened"
    assert expected["draft_tokens"][""] == 0  # the speculation-off request

    # The gateway counts a request when its response has been sent: wait for the last one.
    gw_requests = "specd_gateway_requests_total"
    _eventually(lambda: Scrape(stack["urls"]["gateway"]).get(gw_requests, endpoint="/v1/chat/completions")
                - before["gateway"].get(gw_requests, endpoint="/v1/chat/completions") == n_chat,
                what="the gateway counted every chat request")
    after = scrape(stack)

    def delta(service, name, **labels):
        return after[service].get(name, **labels) - before[service].get(name, **labels)

    # -- verifier: specd_spec_decode_* summed over drafters == the usage the clients saw
    v_before, v_after = before["verifier"], after["verifier"]
    for name, key in zip(SPEC, USAGE_KEYS):
        assert delta("verifier", name) == sum(expected[key].values()), name
        for drafter in ("dm", "ng"):  # and per drafter
            assert delta("verifier", name, drafter=drafter) == expected[key][drafter], (name, drafter)
    accepted = delta("verifier", "specd_spec_decode_num_accepted_tokens_total")
    drafts = delta("verifier", "specd_spec_decode_num_drafts_total")
    draft_tokens = delta("verifier", "specd_spec_decode_num_draft_tokens_total")
    per_pos_name = "specd_spec_decode_num_accepted_tokens_per_pos_total"
    assert delta("verifier", per_pos_name) == accepted
    for drafter in ("dm", "ng"):
        positions = {int(p): v_after.get(per_pos_name, drafter=drafter, position=p)
                     - v_before.get(per_pos_name, drafter=drafter, position=p)
                     for p in v_after.by(per_pos_name, "position")}
        assert sum(positions.values()) == expected["accepted_tokens"][drafter]
        counts = [positions[p] for p in sorted(positions)]
        assert counts == sorted(counts, reverse=True)  # position i+1 is reached only through position i
    acceptance_rate = accepted / draft_tokens
    mean_acceptance_length = 1 + accepted / drafts
    assert 0 <= acceptance_rate <= 1 and 1 <= mean_acceptance_length <= 1 + 4

    # -- verifier: requests, tokens, latencies, step metrics, gauges back to idle
    n = len(calls)
    assert delta("verifier", "specd_verifier_requests_total") == n
    assert delta("verifier", "specd_verifier_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("verifier", "specd_verifier_generation_tokens_total") == sum(u.completion_tokens for u in usages)
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert delta("verifier", f"specd_verifier_{hist}_count") == n, hist
    assert delta("verifier", "specd_verifier_inter_token_latency_seconds_count") > 0
    steps = delta("verifier", "specd_verifier_step_seconds_count")
    assert steps > 0 and delta("verifier", "specd_verifier_batch_size_count") == steps
    assert delta("verifier", "specd_verifier_batch_size_sum") >= steps
    assert v_after.get("specd_verifier_num_requests_running") == 0
    assert v_after.get("specd_verifier_num_requests_waiting") == 0
    assert v_after.get("specd_verifier_kv_blocks_used") == 0 and v_after.get("specd_verifier_kv_blocks_free") > 0
    # the KV caches' pages: the verifier took all of them at start (before any request: RSS holds
    # still while serving); the draft model's (--lazy-kv-cache) the written ones only, which the
    # requests made some of; the n-gram drafter has no cache
    cache_bytes = after["verifier"].get("specd_kv_cache_bytes")
    for scraped in (before, after):
        resident = scraped["verifier"].get("specd_kv_cache_resident_bytes")
        assert cache_bytes <= resident <= cache_bytes + (1 << 20)  # whole pages
    assert 0 < after["dm"].get("specd_kv_cache_resident_bytes") < after["dm"].get("specd_kv_cache_bytes") / 2
    assert after["ng"].get("specd_kv_cache_bytes") == 0
    assert v_after.by("specd_verifier_drafter_healthy", "drafter") == {"dm": 1.0, "ng": 1.0}
    rtts = {d: delta("verifier", "specd_verifier_propose_rtt_seconds_count", drafter=d) for d in ("dm", "ng")}
    assert all(count > 0 for count in rtts.values()), rtts

    # -- drafters: the batches they served cover the round trips the verifier measured
    for d in ("dm", "ng"):
        batches = delta(d, "specd_drafter_propose_batches_total", drafter=d)
        assert batches >= rtts[d] > 0
        assert delta(d, "specd_drafter_propose_entries_total", drafter=d) >= batches
        # every verified draft token was proposed (some proposed ones may be cut at k or arrive late)
        assert delta(d, "specd_drafter_draft_tokens_total", drafter=d) >= expected["draft_tokens"][d]
        assert delta(d, "specd_drafter_propose_seconds_count", drafter=d) == batches
        assert after[d].get("specd_drafter_up", drafter=d) == 1

    # -- gateway: requests by endpoint and status, latency histograms, nothing left running
    assert delta("gateway", gw_requests, endpoint="/v1/chat/completions", status="200") == n_chat
    assert delta("gateway", gw_requests, endpoint="/v1/completions", status="200") == n_text
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert delta("gateway", f"specd_gateway_{hist}_count") == n, hist
    assert delta("gateway", "specd_gateway_inter_token_latency_seconds_count") > 0
    assert after["gateway"].get("specd_gateway_requests_running") == 0


def test_exactness_is_reported_the_same_everywhere(stack):
    """Whether greedy output can change with batching or speculation (the load-time self-test's
    verdict on this machine and dtype) reaches an operator without logs: the verifier's Info and
    its Prometheus gauge, the gateway's /v1/models, and every response object."""
    exact = stack["stub"].Info(pb.InfoRequest(), timeout=10).exact
    assert scrape(stack)["verifier"].get("specd_verifier_exact") == float(exact)
    client = stack["client"]
    assert client.models.list().data[0].model_extra["exact"] is exact
    out = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=4,
                                         messages=[{"role": "user", "content": "hi"}])
    assert out.model_extra["exact"] is exact


def test_the_served_dtype_is_reported(stack):
    """What the weights compute in (what --dtype auto chose on this machine): the verifier's Info
    and the gateway's /v1/models (a reference run elsewhere needs it to compare outputs)."""
    dtype = stack["stub"].Info(pb.InfoRequest(), timeout=10).dtype
    assert dtype in ("float32", "bfloat16", "float16")
    assert stack["client"].models.list().data[0].model_extra["dtype"] == dtype


def test_rejected_requests_are_counted_by_status(stack):
    import openai

    client, url = stack["client"], stack["urls"]["gateway"]
    name = "specd_gateway_requests_total"
    before = Scrape(url)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="x", max_tokens=4)
    _eventually(lambda: Scrape(url).get(name, endpoint="/v1/completions", status="404")
                - before.get(name, endpoint="/v1/completions", status="404") == 1, what="the 404 counted")
    after = Scrape(url)
    assert after.get(name, endpoint="/v1/completions", status="400") - before.get(
        name, endpoint="/v1/completions", status="400") == 1
    # a rejected request is no generation: no latency observed
    assert after.get("specd_gateway_e2e_request_latency_seconds_count") == before.get(
        "specd_gateway_e2e_request_latency_seconds_count")


def test_drafter_health_gauge_is_read_at_scrape_time(stack):
    """A drafter that goes away while the verifier idles shows as unhealthy without any step running."""
    url = stack["urls"]["verifier"]
    assert Scrape(url).by("specd_verifier_drafter_healthy", "drafter") == {"dm": 1.0, "ng": 1.0}
    stack["launcher"].stop(stack["ng"])
    _eventually(lambda: Scrape(url).by("specd_verifier_drafter_healthy", "drafter") == {"dm": 1.0, "ng": 0.0},
                what="ng reported unhealthy")
