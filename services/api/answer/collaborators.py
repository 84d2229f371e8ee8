"""What the API's parts share of the process's state (`ApiContext`), built once per process (`build_context`):
the settings and limits, Redis and its keys, the reply hub, the stage registry, metrics, tenancy, the tracer, the
request store and the open requests, and whether the process is draining. The answer path
(services/api/answer/service.py), the feature APIs and the edge are each given it, or the few parts of it they
use, instead of reaching into one another."""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from services.api.answer.drain import Drain
from services.api.answer.limits import Limits
from services.api.answer.reply_hub import HubLimits, ReplyHub
from services.api.answer.request.requests import Requests
from services.api.multitenancy.tenancy import Tenancy
from services.api.operations.metrics import Metrics
from services.api.operations.registry import StageRegistry
from shared.keys import Keys
from shared.redis_conn import connect
from shared.request_store import RequestStore
from shared.settings import ApiSettings
from shared.tracing import Tracer


@dataclass(frozen=True)
class ApiContext:
    settings: ApiSettings
    limits: Limits
    pod: str
    keys: Keys
    redis: Redis
    hub: ReplyHub
    stages: StageRegistry
    metrics: Metrics
    tenancy: Tenancy  # keys, ownership, quotas
    tracer: Tracer
    store: RequestStore
    requests: Requests
    drain: Drain


def build_context(settings: ApiSettings) -> ApiContext:
    pod, keys = settings.identity(), Keys(settings.namespace)
    redis = connect(settings.redis_url, max_connections=64, **settings.redis_options())
    hub = ReplyHub(settings.redis_url, settings.redis_options(), redis, keys, pod,
                   limits=HubLimits(settings.reply_shard_keys, outage_s=settings.broker_outage_s))
    stages = StageRegistry(redis, keys, settings.heartbeat_ttl_s, settings.model_names())
    metrics = Metrics(stages)
    tracer = Tracer("api", settings.otlp_endpoint)
    store = RequestStore(redis, keys, settings.request_ttl_s, settings.reply_maxlen)
    requests = Requests(settings, store, hub, pod, tracer=tracer, metrics=metrics)
    return ApiContext(settings=settings, limits=Limits(settings), pod=pod, keys=keys, redis=redis, hub=hub,
                      stages=stages, metrics=metrics, tenancy=Tenancy(settings, redis, keys, metrics.tenants),
                      tracer=tracer, store=store, requests=requests, drain=Drain(lambda: len(requests.inflight)))
