"""SLO-aware admission (docs/user-guide.md, "Latency SLOs"; docs/operator-guide.md, "SLO-aware admission").

A request may carry a time-to-first-token target: the header `x-slo-ttft-ms` (llm-d's `x-llm-d-slo-ttft-ms`) or the
body's `slo.ttft_ms` (the body wins), and a time-per-output-token target (`x-slo-tpot-ms`, `x-llm-d-slo-tpot-ms`,
`slo.tpot_ms`), recorded and judged for goodput. Each is 1 to MAX_SLO_MS milliseconds; anything else is a 400 naming
the header or field. With a TTFT target:

- its jobs carry it (shared/messages.py RequestJob `slo_ttft_ms`), and waiting work is ordered earliest deadline
  first within a tenant's fair lane (services/tokenizer/fair.py) and among the engine's waiting requests of one
  priority; work without a target keeps its order behind them, within its own lane only;
- it is refused at once (503 with Retry-After, code `slo_unattainable`) when the work ahead of it cannot let it start
  within its target plus --slo-tolerance-ms (`SloGate.check`);
- admitted, it gets its first token by then or ends with a 503 (`slo_missed`, services/api/answer/request/single.py):
  never served silently late.

Goodput: `rsinfer_slo_requests_total{outcome}` counts met, missed and refused requests with a target;
`rate(...{outcome="met"}[1m])` is the goodput in requests per second.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from services.api.errors import ApiError
from services.api.operations.metrics import Metrics
from services.api.operations.registry import Snapshot
from shared import queued
from shared.keys import Keys

MAX_SLO_MS = 600_000  # ten minutes: a longer target is no target
TTFT_HEADERS = ("x-slo-ttft-ms", "x-llm-d-slo-ttft-ms")
TPOT_HEADERS = ("x-slo-tpot-ms", "x-llm-d-slo-tpot-ms")


@dataclass(frozen=True)
class Slo:
    """A request's targets in milliseconds (0: none)."""

    ttft_ms: int = 0
    tpot_ms: int = 0


def _header_ms(headers: Mapping[str, str], names: tuple[str, ...]) -> int:
    """The first of `names` sent, as whole milliseconds (0 if none); a 400 naming it if it is not 1 to MAX_SLO_MS."""
    for name in names:
        raw = headers.get(name)
        if raw is None:
            continue
        try:
            value = float(raw.strip())
        except ValueError:
            value = math.nan
        if not 1 <= value <= MAX_SLO_MS:
            raise ApiError(400, f"header `{name}` must be a number of milliseconds from 1 to {MAX_SLO_MS}",
                           param=name, code="invalid_slo")
        return round(value)
    return 0


def requested_slo(headers: Mapping[str, str] | None, body_slo: Any = None) -> Slo | None:
    """The request's targets from its headers and its body's `slo` (checked by its schema; it wins), or None."""
    ttft = _header_ms(headers, TTFT_HEADERS) if headers is not None else 0
    tpot = _header_ms(headers, TPOT_HEADERS) if headers is not None else 0
    if body_slo is not None:
        ttft, tpot = getattr(body_slo, "ttft_ms", None) or ttft, getattr(body_slo, "tpot_ms", None) or tpot
    return Slo(ttft, tpot) if ttft or tpot else None


def slo_met(slo: tuple[int, int], started: float, first_token_at: float | None, completion_tokens: int) -> bool:
    """A finished request met its targets (ms: TTFT, TPOT; 0 is none): its first token within the one (from
    `started`), and its tokens after it within the other on average (monotonic seconds, now its end)."""
    if first_token_at is None:
        return False
    ttft_ms, tpot_ms = slo
    tpot_s = (time.monotonic() - first_token_at) / max(1, completion_tokens - 1)
    return ((not ttft_ms or (first_token_at - started) * 1000 <= ttft_ms)
            and (not tpot_ms or tpot_s * 1000 <= tpot_ms))


def fair_ahead(counts: dict[str, int], weights: dict[str, int], tenant: str) -> int:
    """Jobs of other tenants queued ahead of a job at the head of `tenant`'s fair lane: one turn of each (its weight
    against ours), at most what each has queued. Its own tenant's jobs are behind it (earliest deadline first)."""
    mine = max(1, weights.get(tenant, 1))
    return sum(min(c, math.ceil(max(1, weights.get(t, 1)) / mine)) for t, c in counts.items() if t != tenant)


def expected_wait(snap: Snapshot, model: str, ahead: int, service_s: float | None) -> float | None:
    """Seconds until a job with `ahead` jobs queued before it starts: the slots its model's schedulers have (their
    heartbeats' max_running) free up one request's service time apart, per slot. None without a measure."""
    scheds = [w for w in snap.workers if w.role == "scheduler" and w.model == model]
    capacity = sum(int(w.load.get("max_running") or 0) for w in scheds)
    if service_s is None or capacity <= 0:
        return None
    running = sum(int(w.load.get("running") or 0) for w in scheds)
    waiting = sum(int(w.load.get("waiting") or 0) for w in scheds)
    slots_needed = ahead + waiting + 1 - max(0, capacity - running)
    return max(0, slots_needed) * service_s / capacity


class SloGate:
    """Refuses what cannot meet its TTFT target (module doc); counts the refusals."""

    def __init__(self, redis: Any, keys: Keys, metrics: Metrics, tolerance_s: float, fair: bool):
        self.redis, self.keys, self.metrics, self.tolerance_s, self.fair = redis, keys, metrics, tolerance_s, fair

    async def check(self, snap: Snapshot, model: str, tenant: str, slo: Slo | None) -> None:
        if slo is None or not slo.ttft_ms:
            return
        target = slo.ttft_ms / 1000
        wait = expected_wait(snap, model, await self.ahead(snap, model, tenant), self.metrics.service_s.get(model))
        if wait is None or wait <= target + self.tolerance_s:
            return
        self.metrics.slo.labels(model, "refused").inc()
        raise ApiError(503, f"this request cannot start within its time-to-first-token target of {slo.ttft_ms} ms: "
                       f"about {wait:.1f} s of work for model `{model}` is ahead of it; retry later or with a longer "
                       "target", code="slo_unattainable", retry_after=max(1, math.ceil(wait - target)))

    async def ahead(self, snap: Snapshot, model: str, tenant: str) -> int:
        """Jobs of the model's queue (shared/queued.py) that start before one of `tenant`'s with a target: every one
        without fair queueing, else `fair_ahead` and those released to the schedulers already."""
        try:
            queue = await queued.figures(self.redis, self.keys, model)
        except (RedisError, OSError):
            return 0  # admission's own round trips tell Redis' outage; this estimate is not worth a refusal
        if not self.fair:
            return sum(queue.counts.values())
        released = snap.backlog.get(model, {}).get("scheduler")  # released by the tokenizers, not yet read
        return fair_ahead(queue.counts, queue.weights, tenant) + (released.lag if released is not None else 0)

