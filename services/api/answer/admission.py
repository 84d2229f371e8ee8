"""Whether a body is taken now, and what it submits, in one call (`Admission.admit`), before anything is queued:

1. the body's own fields within the server's limits (its `checked`, services/api/answer/schemas/; a 400 naming one);
2. the tenant's policy (services/api/multitenancy/tenancy.py; a 403): the model (and `lora_path`), a `priority` it
   sent, `background`;
3. the base model and LoRA adapter its `model` names (services/api/answer/adapter_target.py; 400, 404), the
   adapter allowed by the key's `models` under its own name (a 403);
4. room for it (`room`): not draining (503), Redis up (503), a known model (404), its fan-out within the limits
   and its jobs within --max-queued (400); with a time-to-first-token target, time to start within it (a 503:
   services/api/answer/slo.py);
5. its uids, minted here in the slots of the reply hub's shards that will read its replies
   (services/api/answer/reply_hub.py `new_uid`), then the jobs, the format and the record the body builds with them;
6. its jobs counted in the model's queue (`enter`, shared/queued.py: a 429 past the tenant's share of
   --max-queued), then the tenant's quota, last, so that a request refused above holds no lease (a 429); a
   request its quota refuses leaves the queue count at once. Its jobs carry the tenant, its weight and a
   priority within its key's range (`leased`: every endpoint's jobs pass there).

What it returns (`Admitted`) is all services/api/answer/request/ needs to open the request. The Responses API
(services/api/responses_api/responses.py) and batch lines (services/api/batch_api/batches.py) are admitted by
the same steps; a tokenizer query by the same steps as a request of one token (`admit_query`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Protocol

from fastapi import Request as HttpRequest
from redis.exceptions import RedisError

from services.api.answer.adapter_target import AdapterTargets
from services.api.answer.limits import jobs_fit_context, omitted_max_tokens
from services.api.answer.request.requests import Admitted
from services.api.answer.schemas.submission import Budget, Stamp, Submission
from services.api.answer.slo import Slo, SloGate, requested_slo
from services.api.errors import ApiError, redis_down
from services.api.multitenancy.tenants import Tenant
from services.api.operations.registry import Snapshot
from shared import queued
from shared.messages import SamplingParams, TokenizeJob
from shared.pages import isolation_salt

if TYPE_CHECKING:
    from services.api.answer.collaborators import ApiContext
    from services.api.answer.limits import Limits


class Body(Protocol):
    """A generating body (services/api/answer/schemas/, services/api/pooling_api/prefill.py)."""

    model: str | None
    lora_path: str | None

    def checked(self, limits: Limits) -> SamplingParams: ...

    def budget(self, params: SamplingParams) -> Budget: ...

    def submission(self, params: SamplingParams, stamp: Stamp) -> Submission: ...


def sent_priority(body: Body) -> int | None:
    """The `priority` the client sent (None when it sent none: the job's default is brought within the key's
    range, services/api/multitenancy/tenancy.py `Tenancy.priority_of`)."""
    return getattr(body, "priority", None) if "priority" in getattr(body, "model_fields_set", ()) else None


class Admission:
    def __init__(self, ctx: ApiContext):
        self.ctx, self.targets = ctx, AdapterTargets(ctx)
        self.settings, self.limits, self.stages, self.tenancy = ctx.settings, ctx.limits, ctx.stages, ctx.tenancy
        self.slos = SloGate(ctx.redis, ctx.keys, ctx.metrics, ctx.settings.slo_tolerance_ms / 1000, ctx.tenancy.on)

    async def admit_from(self, http: HttpRequest, body: Body) -> Admitted:
        """`admit` for the tenant of the HTTP request's key (services/api/edge/app.py `Guard`)."""
        return await self.admit(body, self.tenancy.tenant_of(http), headers=http.headers)

    async def admit(self, body: Body, tenant: Tenant, new_uid: Callable[[], str] | None = None,
                    headers: Mapping[str, str] | None = None) -> Admitted:
        """`new_uid`: where the jobs' uids come from, if not the reply hub (a batch line's are its own); `headers`:
        the HTTP request's, for its SLO headers (services/api/answer/slo.py)."""
        params = body.checked(self.limits)
        slo = requested_slo(headers, getattr(body, "slo", None))
        model, adapter = await self.target(tenant, body.model, body.lora_path, priority=sent_priority(body),
                                           background=getattr(body, "background", None))
        budget = body.budget(params)
        await self.room(model, budget)
        await self.slos.check(self.stages.snapshot, model, tenant.name, slo)
        salt = isolation_salt(tenant.cache_scope, getattr(body, "cache_salt", None))
        stamp = self.stamp(model, adapter, budget.prompts, new_uid, cache_salt=salt, slo=slo)
        submission = body.submission(params, stamp)
        jobs_fit_context(submission.jobs, stamp.model_info, budget.prompts_param)
        return await self.leased(submission, tenant)

    @contextlib.asynccontextmanager
    async def admit_query(self, tenant: Tenant, name: str | None) -> AsyncIterator[str]:
        """A tokenizer query (/tokenize, /detokenize, services/api/tokenize_api/) taken by the same steps as a
        request of one token: the policy, the base model its `model` names (an adapter shares its base's tokenizer),
        room (a draining server or an unknown model refuse it; a query is not counted in the model's queue: no
        scheduler takes it, and the tokenizers read on past any backlog), then its tenant's quota (concurrency and
        requests per minute), held while the query runs. Yields the model whose tokenizer answers it."""
        model, _ = await self.target(tenant, name)
        await self.room(model, Budget(prompts=1, choices=1, max_tokens=1))
        async with self.tenancy.admitted(tenant):
            yield model

    async def target(self, tenant: Tenant, name: str | None, lora_path: str | None = None, *,
                     priority: int | None = None, background: bool | None = None) -> tuple[str, str | None]:
        """Steps 2 and 3 (module doc): the tenant's policy, then the base model and the adapter (or None) that
        `name` and `lora_path` name, the adapter allowed under its own name. Only /generate and the tokenizer
        queries may leave the model out (the server's only one)."""
        name = name or self.only_model()
        self.tenancy.authorize(tenant, name, lora_path=lora_path, priority=priority, background=background)
        model, adapter = await self.targets.target(name, lora_path)  # an adapter: its base model and it
        self.tenancy.authorize_adapter(tenant, adapter, "model" if lora_path is None else "lora_path")
        return model, adapter

    async def leased(self, submission: Submission, tenant: Tenant) -> Admitted:
        """The submission as its tenant's (record fields, the jobs' turn in fair queueing), within its quota."""
        tenancy = self.tenancy
        jobs = tenancy.stamp(submission.jobs, tenant)
        record = {**submission.record, **tenancy.record_fields(tenant)}
        first = jobs[0]
        await self.enter(jobs)  # stamped with their tenant
        try:
            lease = await tenancy.admit(tenant, self.reserve(jobs), first.uid, max(j.deadline for j in jobs))
        except BaseException:
            with contextlib.suppress(RedisError, OSError):  # else they leave the count at their deadline
                await queued.leave(self.ctx.redis, self.ctx.keys, first.model, queued.members(jobs))
            raise
        return Admitted(dataclasses.replace(submission, jobs=jobs, record=record), lease)

    def reserve(self, jobs: list[TokenizeJob]) -> int:
        """The most tokens the jobs may generate, which their tenant's tokens_per_minute reserves at admission
        (services/api/multitenancy/quotas.py): each choice's max_tokens, or where it is omitted what its tokenizer
        gives such a request (the model's default_max_tokens, services/tokenizer/encode.py), else the model's
        context."""
        info = self.stages.snapshot.model_info(jobs[0].model)
        omitted = omitted_max_tokens(info.get("default_max_tokens"), info.get("max_model_len"))
        return sum(j.params.n * (j.params.max_tokens if j.params.max_tokens is not None else omitted) for j in jobs)

    def stamp(self, model: str, adapter: str | None, prompts: int, new_uid: Callable[[], str] | None = None, *,
              cache_salt: str = "", slo: Slo | None = None) -> Stamp:
        """What this process adds to the jobs of a request of `prompts` prompts for `model`, their uids minted
        now (one per prompt), with their prefix-cache salt and latency targets."""
        mint = new_uid or self.ctx.hub.new_uid
        uids = iter([mint() for _ in range(prompts)])
        return Stamp(model, self.ctx.pod, self.settings.request_timeout_s, uids.__next__,
                     self.stages.snapshot.model_info(model), adapter, cache_salt, slo)

    def only_model(self) -> str:
        models = self.stages.snapshot.known()
        if len(models) != 1:
            raise ApiError(400, "give `model`: this server serves " + (", ".join(models) or "no model"),
                           param="model")
        return models[0]

    async def room(self, model: str, budget: Budget) -> None:
        """Refuse what cannot be taken now; a known model with no worker in some stage is accepted: its
        request waits in the model's streams, within its deadline, for workers (scale from zero). Every job
        of the request (one per prompt) counts against --max-queued."""
        if self.ctx.drain.draining:
            raise ApiError(503, "this server is shutting down; retry on another", retry_after=1)
        snap = await self._fresh_if(lambda s: model not in s.models)  # it may have been declared since
        if not snap.redis_ok:
            raise redis_down()
        if model not in snap.models:
            raise ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        info = snap.model_info(model)
        self.limits.fan_out(budget, info.get("max_model_len"), info.get("default_max_tokens"))
        jobs, most = budget.prompts, self.settings.max_queued
        if jobs > most:
            raise ApiError(400, f"{jobs} prompts are more than this server queues for a model: at most {most} "
                           "(--max-queued); send them in smaller requests", param=budget.prompts_param,
                           code="request_too_large")
        # Whether the model's queue has room for them is counted in Redis, with their uids (`enter`).

    async def enter(self, jobs: list[TokenizeJob]) -> None:
        """Count the request's jobs in their model's queue, atomically across API processes (shared/queued.py): a
        429 past the tenant's share of --max-queued, unless the queue has room to spare."""
        job, most = jobs[0], self.settings.max_queued
        got = await queued.enter(self.ctx.redis, self.ctx.keys, jobs, most)
        if not got.admitted:
            raise ApiError(429, f"model `{job.model}` has {got.total} requests queued, {got.mine} of them yours, and "
                           f"this one adds {len(jobs)}; your share is {got.share} of {most} (--max-queued) while "
                           "others queue: retry shortly", code="overloaded", retry_after=1)

    async def _fresh_if(self, stale: Callable[[Snapshot], bool]) -> Snapshot:
        """The registry's snapshot, refreshed first if `stale(snapshot)` and it is over 0.25 s old."""
        snap = self.stages.snapshot
        if stale(snap) and time.time() - snap.at > 0.25:
            snap = await self.stages.refresh()
        return snap

