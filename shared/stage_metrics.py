"""A stage worker's own Prometheus metrics, served on `--metrics-port` (0: off, no server, no middleware).

The tokenizer and detokenizer get FastStream's Prometheus middleware on their subscribers: received entries,
processing durations, entries in process and exceptions (`faststream_received_*`, labelled by the stream). Every
stage adds what FastStream cannot see, because we publish with our own pipelines and the scheduler reads with
its own loop: entries published per stream (`rsinfer_stage_published_entries_total`), and for the scheduler
entries admitted (`rsinfer_stage_consumed_entries_total`) and engine step durations
(`rsinfer_scheduler_step_seconds`). The API's /metrics keeps the pipeline-wide view read from Redis.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class WorkerMetrics:
    def __init__(self, role: str, port: int):
        self.role, self.port = role, port
        self.enabled = port > 0
        if not self.enabled:
            return
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self._published = Counter("rsinfer_stage_published_entries", "stream entries this worker published",
                                  ["role", "stream"], registry=self.registry)
        self._consumed = Counter("rsinfer_stage_consumed_entries", "stream entries the scheduler admitted",
                                 ["role", "stream"], registry=self.registry)
        self._steps = Histogram("rsinfer_scheduler_step_seconds", "engine step duration", ["role"],
                                buckets=STEP_BUCKETS, registry=self.registry)

    def faststream_middlewares(self) -> tuple[Any, ...]:
        if not self.enabled:
            return ()
        from faststream.redis.prometheus import RedisPrometheusMiddleware

        return (RedisPrometheusMiddleware(registry=self.registry, app_name=f"rsinfer-{self.role}"),)

    def serve(self) -> None:
        if self.enabled:
            from prometheus_client import start_http_server

            start_http_server(self.port, registry=self.registry)
            log.info("metrics on :%d/metrics", self.port)

    def published(self, stream: str, count: int = 1) -> None:
        if self.enabled and count:
            self._published.labels(self.role, stream).inc(count)

    def consumed(self, stream: str, count: int) -> None:
        if self.enabled and count:
            self._consumed.labels(self.role, stream).inc(count)

    def step(self, seconds: float) -> None:
        if self.enabled:
            self._steps.labels(self.role).observe(seconds)
