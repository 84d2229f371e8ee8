"""Prometheus metrics of one API process, plus stage-level gauges read from Redis (worker heartbeats and
consumer-group backlogs), so that one scrape target covers the whole pipeline.

Where `--api-workers` runs several processes on one port, a scrape reaches any one of them and each must show
the pod's figures: their supervisor (rsinfer/api_workers.py) gives them a PROMETHEUS_MULTIPROC_DIR, where
prometheus_client keeps every process's values in files, and each renders the sum over them (the counters and
histograms of every process that ran, a restarted one's included; the gauges of the live ones)."""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from services.api.operations.registry import StageRegistry

SERVICE_EWMA = 0.2  # the weight of the latest request in `Metrics.service_s`
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class _StageCollector:
    def __init__(self, stages: StageRegistry):
        self.stages = stages

    def collect(self):
        snap = self.stages.snapshot
        workers = GaugeMetricFamily("rsinfer_stage_workers", "live workers per stage", labels=["model", "stage"])
        lag = GaugeMetricFamily("rsinfer_stage_lag", "entries not yet delivered to the stage's group",
                                labels=["model", "stage"])
        pending = GaugeMetricFamily("rsinfer_stage_pending", "entries delivered but not acknowledged",
                                    labels=["model", "stage"])
        running = GaugeMetricFamily("rsinfer_scheduler_running", "requests in the running batch",
                                    labels=["model", "worker"])
        waiting = GaugeMetricFamily("rsinfer_scheduler_waiting", "requests admitted but waiting for KV room",
                                    labels=["model", "worker"])
        kv = GaugeMetricFamily("rsinfer_kv_cache_usage_ratio", "share of KV cache in use", labels=["model", "worker"])
        for model, counts in snap.models.items():
            for stage, count in counts.items():
                workers.add_metric([model, stage], count)
            for stage, b in snap.backlog.get(model, {}).items():
                lag.add_metric([model, stage], b.lag)
                pending.add_metric([model, stage], b.pending)
        for w in snap.workers:
            if w.role == "scheduler":
                running.add_metric([w.model, w.id], w.load.get("running", 0))
                waiting.add_metric([w.model, w.id], w.load.get("waiting", 0))
                total = w.load.get("kv_total_tokens") or 0
                kv.add_metric([w.model, w.id], (w.load.get("kv_used_tokens", 0) / total) if total else 0.0)
        yield from (workers, lag, pending, running, waiting, kv)


class _Shared:
    """The series of every process of the group (the multiprocess files), with or without the tenants' ones."""

    def __init__(self, path: str, tenants: bool, helps: dict[str, str]):
        self.files, self.tenants, self.helps = MultiProcessCollector(None, path), tenants, helps

    def collect(self):
        shown = [m for m in self.files.collect() if m.name.startswith(TENANT_PREFIX) == self.tenants]
        for m in shown:  # the files keep no HELP text
            m.documentation = self.helps.get(m.name, m.documentation)
        return shown


TENANT_PREFIX = "rsinfer_tenant_"  # services/api/multitenancy/quotas.py


class Metrics:
    def __init__(self, stages: StageRegistry, shared_dir: str | None = None):
        self.registry = CollectorRegistry()
        # series labelled with tenants' names (services/api/multitenancy/tenancy.py): rendered for admin keys only,
        # since a tenant's name and usage are not for other tenants nor for keyless callers
        self.tenants = CollectorRegistry()
        r = self.registry
        self.requests = Counter("rsinfer_http_requests", "HTTP requests", ["model", "endpoint", "status"],
                                registry=r)
        self.duration = Histogram("rsinfer_request_duration_seconds", "request duration", ["model"],
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("rsinfer_time_to_first_token_seconds", "time to first token", ["model"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("rsinfer_prompt_tokens", "prompt tokens", ["model"], registry=r)
        self.generated_tokens = Counter("rsinfer_generated_tokens", "completion tokens", ["model"], registry=r)
        self.inflight = Gauge("rsinfer_inflight_requests", "requests in flight in this process (of --api-workers': "
                              "in them all)", ["model"], registry=r, multiprocess_mode="livesum")
        # durable work (services/api/responses_api/responses.py, services/api/batch_api/batches.py), counted where it
        # ends
        self.responses = Counter("rsinfer_responses", "stored responses that ended, by status", ["status"],
                                 registry=r)
        self.batches = Counter("rsinfer_batches", "batches this process ran to their end, by status", ["status"],
                               registry=r)
        self.batch_lines = Counter("rsinfer_batch_lines", "batch lines this process ran to their end: ok or "
                                   "error (the output or the error file)", ["outcome"], registry=r)
        self.batches_running = Gauge("rsinfer_batches_running", "batches this process runs now", registry=r,
                                     multiprocess_mode="livesum")
        # SLO-aware admission (services/api/answer/slo.py): requests with a target, by outcome (met, missed, refused);
        # the goodput is the rate of those met. `service_s`: each model's recent service time of a request (from
        # its first token to its end, a moving average), what admission estimates a queue's wait with.
        self.slo = Counter("rsinfer_slo_requests", "requests with a latency SLO by outcome: met, missed, refused "
                           "(goodput: the rate of met)", ["model", "outcome"], registry=r)
        self.service_s: dict[str, float] = {}
        # of --api-workers: what renders, the group's series rather than this process's own
        shared_dir = shared_dir if shared_dir is not None else os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        self.shown, self.shown_tenants = self.registry, self.tenants
        if shared_dir:
            helps = {f.name: f.documentation for m in (self.requests, self.duration, self.ttft, self.prompt_tokens,
                     self.generated_tokens, self.inflight, self.responses, self.batches, self.batch_lines,
                     self.batches_running, self.slo) for f in m.describe()}
            self.shown, self.shown_tenants = CollectorRegistry(), CollectorRegistry()
            self.shown.register(_Shared(shared_dir, False, helps))
            self.shown_tenants.register(_Shared(shared_dir, True, helps))
        self.add_collector(_StageCollector(stages))

    def add_collector(self, collector) -> None:
        """A collector of series this process reads rather than counts (from Redis): rendered as it is."""
        self.registry.register(collector)
        if self.shown is not self.registry:
            self.shown.register(collector)

    def served(self, model: str, seconds: float) -> None:
        """A request of `model` took `seconds` from its first token to its end (`service_s`)."""
        before = self.service_s.get(model)
        self.service_s[model] = seconds if before is None else before + SERVICE_EWMA * (seconds - before)

    def render(self, tenants: bool = False) -> bytes:
        return generate_latest(self.shown) + (generate_latest(self.shown_tenants) if tenants else b"")
