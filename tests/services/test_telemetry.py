"""OpenTelemetry across the services: one request is one trace spanning gateway, verifier and drafter.

The services run as real processes (conftest's launcher) with SPECD_TRACE_FILE set, so each
writes its finished spans as JSON lines through the same TracerProvider setup that OTLP export
uses; the test reads them back. Tracing off (the default) is checked in a fresh interpreter.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from specd.models.demo_paths import demo_model_dir

MODEL_DIR = demo_model_dir("target")
pytestmark = pytest.mark.skipif(not (MODEL_DIR / "config.json").is_file(), reason="the bundled demo target is missing")

PROMPT = "def fibonacci(n):\n    "


def _start(launcher, name, command, args, trace_file: Path | None, **kw):
    """launcher.start with SPECD_TRACE_FILE set (or unset) for that one child process."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
        if trace_file is None:
            mp.delenv("SPECD_TRACE_FILE", raising=False)
        else:
            mp.setenv("SPECD_TRACE_FILE", str(trace_file))
        return launcher.start(name, command, args, **kw)


@pytest.fixture(scope="module")
def stack(launcher, tmp_path_factory):
    files = tmp_path_factory.mktemp("traces")
    traces = {name: files / f"{name}.jsonl" for name in ("gateway", "verifier", "drafter")}
    drafter = _start(launcher, "drafter", "drafter", ["--method", "draft_model", "--name", "dm",
                                                      "--model", str(demo_model_dir("drafter")),
                                                      "--log-level", "warning"], traces["drafter"])
    verifier = _start(launcher, "verifier", "verifier", ["--drafter", f"dm={drafter.address}",
                                                         "--model", str(MODEL_DIR), "--log-level", "warning"],
                      traces["verifier"])
    gateway = _start(launcher, "gateway", "gateway", ["--verifier", verifier.address, "--log-level", "warning"],
                     traces["gateway"], http=True)
    return dict(launcher=launcher, verifier=verifier, gateway=gateway, traces=traces)


def _client(gateway):
    import openai

    return openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="x", max_retries=0, timeout=120)


def _spans(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait_spans(stack, cond, timeout=30.0) -> dict[str, list[dict]]:
    """All spans per service, once cond(spans) holds (a span is written when it ends)."""
    deadline = time.monotonic() + timeout
    while True:
        spans = {name: _spans(path) for name, path in stack["traces"].items()}
        if cond(spans):
            return spans
        if time.monotonic() > deadline:
            raise AssertionError(f"spans did not arrive: { {k: [s['name'] for s in v] for k, v in spans.items()} }")
        time.sleep(0.1)


def _tid(span):
    return span["context"]["trace_id"]


def _sid(span):
    return span["context"]["span_id"]


def _by_request(spans, request_id, name):
    return [s for s in spans if s["name"] == name and s["attributes"].get("specd.request_id") == request_id]


def test_one_request_is_one_trace_across_gateway_verifier_and_drafter(stack):
    client = _client(stack["gateway"])
    # num_speculative_tokens pins k (no adaptive k = 0), so every decode step asks the drafter
    out = client.chat.completions.create(messages=[{"role": "user", "content": PROMPT}], model="specd-demo-target",
                                         max_tokens=24, temperature=0,
                                         extra_body={"speculative": {"num_speculative_tokens": 3}})
    spec = out.usage.model_extra["speculative"]
    assert spec["draft_tokens"] > 0, "no speculation happened"

    spans = _wait_spans(stack, lambda s: _by_request(s["gateway"], out.id, "gateway /v1/chat/completions")
                        and _by_request(s["verifier"], out.id, "verifier.generate"))
    (gw,) = _by_request(spans["gateway"], out.id, "gateway /v1/chat/completions")
    (gen,) = _by_request(spans["verifier"], out.id, "verifier.generate")
    trace_id = _tid(gw)

    # gateway: a root server span with the request's shape
    assert gw["parent_id"] is None and gw["kind"] == "SpanKind.SERVER"
    assert gw["resource"]["attributes"]["service.name"] == "specd-gateway"
    a = gw["attributes"]
    assert a["gen_ai.request.model"] == out.model and a["specd.stream"] is False
    assert a["gen_ai.usage.input_tokens"] == out.usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == out.usage.completion_tokens
    assert a["gen_ai.response.finish_reasons"] == [out.choices[0].finish_reason]
    assert a["http.response.status_code"] == 200

    # verifier: the request span is the gateway span's child (trace context in the gRPC metadata)
    assert _tid(gen) == trace_id and gen["parent_id"] == _sid(gw)
    assert gen["resource"]["attributes"]["service.name"] == "specd-verifier"
    assert gen["attributes"]["gen_ai.usage.output_tokens"] == out.usage.completion_tokens
    assert gen["attributes"]["specd.spec.draft_tokens"] == spec["draft_tokens"]

    # steps: children of the (only) request span, linked to it; together they add up to the request
    steps = [s for s in spans["verifier"] if s["name"] == "verifier.step" and _tid(s) == trace_id]
    assert len(steps) >= 2  # prefill, then decode steps
    for s in steps:
        assert s["parent_id"] == _sid(gen)
        assert [link["context"]["span_id"] for link in s["links"]] == [_sid(gen)]
    assert sum(s["attributes"]["specd.spec.draft_tokens"] for s in steps) == spec["draft_tokens"]
    assert sum(s["attributes"]["specd.spec.accepted_tokens"] for s in steps) == spec["accepted_tokens"]
    assert sum(s["attributes"]["specd.spec.drafts"] for s in steps) == spec["drafts"]
    assert all(s["attributes"]["specd.batch_size"] == 1 for s in steps)
    assert sum(s["attributes"]["specd.step.tokens"] for s in steps) >= out.usage.prompt_tokens + len(steps) - 1

    # drafter: every propose call of this request joined the trace, under one of its steps
    proposes = [s for s in spans["drafter"] if s["name"] == "drafter.propose" and _tid(s) == trace_id]
    assert proposes and {s["parent_id"] for s in proposes} <= {_sid(s) for s in steps}
    assert all(s["resource"]["attributes"]["service.name"] == "specd-drafter" for s in proposes)
    assert sum(s["attributes"]["specd.batch_size"] for s in proposes) >= 1
    assert sum(s["attributes"]["specd.spec.draft_tokens"] for s in proposes) >= spec["draft_tokens"]
    # the only drafter spans outside a request's trace are the pool's empty warm-up batches
    assert all(s["attributes"]["specd.batch_size"] == 0 for s in spans["drafter"] if s["parent_id"] is None)


def test_a_shared_step_links_every_request_and_belongs_to_the_oldest(stack):
    client = _client(stack["gateway"])

    def ask(i):
        return client.completions.create(model="specd-demo-target", prompt=PROMPT * (i + 1), max_tokens=32,
                                         temperature=0)

    with ThreadPoolExecutor(2) as ex:
        outs = list(ex.map(ask, range(2)))
    spans = _wait_spans(stack, lambda s: all(_by_request(s["gateway"], o.id, "gateway /v1/completions")
                                             and _by_request(s["verifier"], o.id, "verifier.generate") for o in outs))
    gens = {}
    for o in outs:
        (gw,) = _by_request(spans["gateway"], o.id, "gateway /v1/completions")
        (gen,) = _by_request(spans["verifier"], o.id, "verifier.generate")
        assert _tid(gen) == _tid(gw) and gen["parent_id"] == _sid(gw)
        gens[_sid(gen)] = gen
    assert len({_tid(g) for g in gens.values()}) == 2  # two requests, two traces
    steps = [s for s in spans["verifier"] if s["name"] == "verifier.step"
             and any(link["context"]["span_id"] in gens for link in s["links"])]
    for s in steps:
        linked = [link["context"]["span_id"] for link in s["links"]]
        assert set(linked) <= set(gens) and s["parent_id"] == linked[0]  # parent: the oldest in flight
        assert _tid(s) == _tid(gens[linked[0]])
    # every request reaches its steps: by parenthood or by link
    assert all(any(sid in [link["context"]["span_id"] for link in s["links"]] for s in steps) for sid in gens)
    assert any(len(s["links"]) == 2 for s in steps), "the two requests never shared a step"


def test_an_untraced_gateway_sends_no_trace_context(stack):
    """Tracing off in the gateway: nothing travels, so the verifier's request span starts its own trace."""
    launcher = stack["launcher"]
    plain = _start(launcher, "gateway-untraced", "gateway", ["--verifier", stack["verifier"].address,
                                                             "--log-level", "warning"], None, http=True)
    try:
        out = _client(plain).completions.create(model="specd-demo-target", prompt=PROMPT, max_tokens=4,
                                                temperature=0)
        spans = _wait_spans(stack, lambda s: _by_request(s["verifier"], out.id, "verifier.generate"))
        (gen,) = _by_request(spans["verifier"], out.id, "verifier.generate")
        assert gen["parent_id"] is None
        assert not _by_request(spans["gateway"], out.id, "gateway /v1/completions")
    finally:
        launcher.stop(plain)


def _python(code: str, **env) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("OTEL_EXPORTER_OTLP_ENDPOINT", "SPECD_TRACE_FILE")}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**base, **env}, capture_output=True,
                          text=True, timeout=120)


def test_tracing_is_off_by_default():
    """No endpoint, no trace file: no provider is installed, spans do not record, nothing is injected."""
    proc = _python("""
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from specd.rpc import telemetry

        assert telemetry.setup_tracing("specd-test") is False
        assert not isinstance(trace.get_tracer_provider(), TracerProvider)
        with telemetry.tracer("specd.test").start_as_current_span("request") as span:
            assert not span.is_recording() and not span.get_span_context().is_valid
            assert telemetry.inject_metadata() is None and telemetry.current_traceparent() == ""
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_trace_context_helpers_round_trip():
    """The helpers the services use: gRPC metadata and the ProposeBatch traceparent string."""
    proc = _python("""
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        from specd.rpc import telemetry

        provider, exporter = TracerProvider(), InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        t = telemetry.tracer("specd.test")
        with t.start_as_current_span("gateway") as gw:
            metadata = telemetry.inject_metadata()
        assert dict(metadata)["traceparent"].split("-")[2] == format(gw.get_span_context().span_id, "016x")
        with t.start_as_current_span("verifier", context=telemetry.extract_metadata(metadata)) as v:
            traceparent = telemetry.current_traceparent()
        with t.start_as_current_span("drafter", context=telemetry.context_from_traceparent(traceparent)):
            pass
        gw_s, v_s, d_s = sorted(exporter.get_finished_spans(), key=lambda s: s.start_time)
        assert len({s.context.trace_id for s in (gw_s, v_s, d_s)}) == 1
        assert v_s.parent.span_id == gw_s.context.span_id and d_s.parent.span_id == v_s.context.span_id
        assert telemetry.extract_metadata([("user-agent", "grpc")]) is not None  # no context: a root
        assert telemetry.context_from_traceparent("") is None
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_otlp_endpoint_without_the_exporter_warns_once_and_goes_on():
    proc = _python("""
        import logging, sys
        sys.modules["opentelemetry.exporter.otlp.proto.grpc.trace_exporter"] = None  # as if not installed
        logging.basicConfig(level=logging.INFO)
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from specd.rpc import telemetry

        assert telemetry.setup_tracing("specd-test") is False
        assert not isinstance(trace.get_tracer_provider(), TracerProvider)
        print("ok")
    """, OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:4317")
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    assert proc.stderr.count("WARNING:specd.rpc.telemetry") == 1 and "specd[otel]" in proc.stderr


def test_otlp_endpoint_with_the_exporter_installs_a_provider():
    pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc.trace_exporter")
    proc = _python("""
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from specd.rpc import telemetry

        assert telemetry.setup_tracing("specd-test") is True
        provider = trace.get_tracer_provider()
        assert isinstance(provider, TracerProvider)
        assert provider.resource.attributes["service.name"] == "specd-test"
        with telemetry.tracer("specd.test").start_as_current_span("x") as span:
            assert span.is_recording()
        print("ok")
    """, OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:1", OTEL_BSP_EXPORT_TIMEOUT="100")
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
