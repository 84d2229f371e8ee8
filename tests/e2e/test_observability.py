"""Observability across processes. With --otlp-endpoint, one request is one OpenTelemetry trace with a span
in each of the four processes (API, tokenizer, scheduler, detokenizer), exported over OTLP/HTTP to a collector
(here a real HTTP server in the test that decodes the protobuf export requests). With --metrics-port, each
worker serves its own Prometheus metrics."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.support.helpers import wait_for
from tests.support.stack import MODEL, Stack, running_pipeline

pytestmark = pytest.mark.timeout(120)


class Collector(ThreadingHTTPServer):
    def __init__(self):
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Receive)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def of_request(self, uid: str) -> list[dict]:
        with self.lock:
            return [s for s in self.spans if s["attributes"].get("uid") == uid]


class _Receive(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        export = ExportTraceServiceRequest.FromString(self.rfile.read(int(self.headers["Content-Length"])))
        spans = []
        for rs in export.resource_spans:
            service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
            for ss in rs.scope_spans:
                for sp in ss.spans:
                    attrs = {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in sp.attributes}
                    spans.append({"service": service, "name": sp.name, "trace": sp.trace_id.hex(),
                                  "id": sp.span_id.hex(), "parent": sp.parent_span_id.hex(), "attributes": attrs,
                                  "ms": (sp.end_time_unix_nano - sp.start_time_unix_nano) / 1e6})
        with self.server.lock:
            self.server.spans.extend(spans)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *_) -> None:
        pass


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    server = Collector()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def traced(redis_server, demo_model_dir, tmp_path_factory, collector) -> Iterator[Stack]:
    with running_pipeline(redis_server, demo_model_dir, tmp_path_factory, "trace",
                          RSINFER_OTLP_ENDPOINT=collector.url, OTEL_BSP_SCHEDULE_DELAY="100") as s:
        yield s


SERVICES = {"rsinfer-api", "rsinfer-tokenizer", "rsinfer-scheduler", "rsinfer-detokenizer"}


@pytest.mark.parametrize("stream", [True, False])
def test_one_request_is_one_trace_across_the_four_processes(traced, collector, stream):
    client = traced.client()
    args = dict(model=MODEL, messages=[{"role": "user", "content": "trace me"}], max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True})  # 12 steps: the demo model would end its answer sooner
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **args))  # read to the end
        rid = chunks[0].id
    else:
        rid = client.chat.completions.create(**args).id
    uid = rid.removeprefix("chatcmpl-")
    wait_for(lambda: {s["service"] for s in collector.of_request(uid)} >= SERVICES
             and any(s["name"] == "request" for s in collector.of_request(uid)), timeout=20, every=0.1)
    spans = collector.of_request(uid)
    assert len({s["trace"] for s in spans}) == 1  # one trace id across every process
    [root] = [s for s in spans if s["name"] == "request"]
    assert root["service"] == "rsinfer-api" and root["parent"] == ""
    by_name = {s["name"]: s for s in spans}
    assert {"tokenize", "schedule", "detokenize"} <= set(by_name)
    for s in spans:
        if s is not root:
            assert s["parent"] == root["id"], s  # each stage's span hangs under the request
    assert by_name["schedule"]["attributes"]["steps"] >= 12
    assert root["attributes"]["status"] == "ok"


def test_no_endpoint_no_trace_field(stack):
    """Tracing off (the session stack): the messages carry no trace context at all."""
    r = stack.redis()
    reply = stack.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                   max_tokens=2)
    uid = reply.id.removeprefix("chatcmpl-")
    entries = r.xrange(stack.keys.tokenize(MODEL))
    # .get: other tests put poison entries (no data field) in this stream to see them dead-lettered
    assert entries and all('"trace"' not in f.get("data", "") for _, f in entries)
    assert uid


def test_workers_serve_their_own_metrics(redis_server, demo_model_dir, tmp_path_factory):
    """--metrics-port: FastStream's consume metrics for the tokenizer and detokenizer subscribers, and the
    entries each stage published, on each worker's own /metrics."""
    import httpx

    from rsinfer.redis_server import free_port

    ports = {role: free_port() for role in ("tokenizer", "scheduler", "detokenizer")}
    s = Stack(redis_server.url, demo_model_dir, "wm" + tmp_path_factory.mktemp("x").name[-6:],
              tmp_path_factory.mktemp("logs-wm"))
    try:
        for role, port in ports.items():
            s.start(f"{role}1", role, RSINFER_METRICS_PORT=str(port))
        s.start("api1", "api")
        s.wait_ready()
        s.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "m"}], max_tokens=5)

        def scrape(role: str) -> str:
            return httpx.get(f"http://127.0.0.1:{ports[role]}/metrics", timeout=5).text

        tok, sched, detok = scrape("tokenizer"), scrape("scheduler"), scrape("detokenizer")
        assert 'faststream_received_messages_total{app_name="rsinfer-tokenizer"' in tok
        assert "faststream_received_processed_messages_duration_seconds_bucket" in detok
        assert 'rsinfer_stage_published_entries_total{role="tokenizer",stream="schedule"} 1.0' in tok
        assert 'rsinfer_stage_consumed_entries_total{role="scheduler",stream="schedule"} 1.0' in sched
        assert "rsinfer_scheduler_step_seconds_count" in sched
        assert 'rsinfer_stage_published_entries_total{role="detokenizer",stream="reply"}' in detok
    finally:
        s.stop()
