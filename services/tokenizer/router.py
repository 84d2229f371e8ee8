"""The tokenizer's side of prefix-aware routing (docs/design.md, "Prefix-aware routing"): a schedule job goes to
the scheduler whose prefix cache already holds the longest prefix of its tokens, weighted by that scheduler's load.

- Page digests. The engine's prefix cache names a full KV page by a blake2b digest chained over every token up to
  its end (shared/pages.py); the same function lets the tokenizer name the pages of a prompt it encoded.
- What schedulers publish: services/scheduler/lanes.py `SchedulerLanes`, once a routing tokenizer's flag
  (`Keys.prefix_routing`, set with its heartbeat: `Router.on_beat`) tells them to.
- The choice (`Router`). Per tokenizer batch, one pipelined round trip (SMISMEMBER per live scheduler, and
  XINFO GROUPS of its own stream: what it has not finished of the jobs routed to it) tells how
  many leading pages of each job every scheduler holds; a job goes to the scheduler with the most cached tokens
  less `load_tokens` per request it runs or queues, or to the shared stream when no scheduler holds a page of it
  (or one that holds none is the better choice): the shared stream is the default and the fallback.
- The bound (`max_skew`). Only a scheduler within `max_skew` requests of the least loaded one is chosen for its
  cache: a few hot prefixes would otherwise keep most of the work on the replicas that first cached them while
  others idle (bench/prefix_routing.py). Past it a job goes to the shared stream, which whoever has room reads,
  and the prefix gets cached there too.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from redis.asyncio import Redis

from shared import streams
from shared.heartbeats import live_workers
from shared.keys import SCHEDULER_GROUP, Keys
from shared.pages import extend_digests, prefix_root

log = logging.getLogger(__name__)

# Leading pages of a prompt the tokenizer scores (16k tokens at 16 a page): past them a longer match hardly
# changes a choice, and each costs ~35 bytes per scheduler in the round trip.
MAX_SCORED_PAGES = 1024


def prompt_pages(input_ids: Sequence[int], page_size: int, cache_salt: str = "") -> list[str]:
    """Hex digests of the pages of a prompt an engine could read from its cache: its full pages but the one
    holding its last token (the engine always computes that one: services/scheduler/engine/scheduler.py), named
    under the job's cache salt as the engine names them (shared/pages.py `prefix_root`)."""
    digests: list[bytes] = []
    extend_digests(digests, list(input_ids), page_size, min(MAX_SCORED_PAGES, (len(input_ids) - 1) // page_size),
                   prefix_root(None, cache_salt))
    return [d.hex() for d in digests]


@dataclass
class Candidate:
    """A live scheduler that publishes its pages, as its last heartbeat tells."""

    id: str
    page_size: int
    load: float  # requests running and waiting in its engine at its last heartbeat
    beat_at: float = 0.0  # when that was (its clock)
    adapters: frozenset[str] = frozenset()  # names of the LoRA adapters loaded in its engine
    free_slots: int = 0  # LoRA slots holding no adapter


@dataclass(frozen=True)
class Policy:
    """How `choose` weighs a cached prefix against load (TokenizerSettings' prefix_routing_*)."""

    load_tokens: float  # cached prompt tokens one request a scheduler holds is worth
    max_skew: float = math.inf  # most requests over the least loaded scheduler's that one chosen for its cache holds


def choose(cached: dict[str, int], load: dict[str, float], load_tokens: float,
           max_skew: float = math.inf) -> str | None:
    """The scheduler a job goes to: among those holding at most `max_skew` requests more than the least loaded,
    the most cached prompt tokens less `load_tokens` per request it holds; None (the shared stream, which whoever
    has room reads) when the best of them has no page of the job."""
    if not cached:
        return None
    floor = min(load[s] for s in cached)
    within = [s for s in cached if load[s] - floor <= max_skew]
    best = max(within, key=lambda s: (cached[s] - load_tokens * load[s], cached[s], -load[s], s))
    return best if cached[best] > 0 else None


def choose_for_adapter(adapter: str, candidates: Sequence[Candidate], load: dict[str, float]) -> str | None:
    """The scheduler a job with LoRA adapter `adapter` goes to: the least loaded one holding it loaded, else the
    least loaded one with a free slot, else None (the shared stream). Its prompt's pages are not scored: they are
    named from the adapter's registration (shared/pages.py `adapter_root`), which only schedulers resolve."""
    for fits in (lambda c: adapter in c.adapters, lambda c: c.free_slots > 0):
        ids = [c.id for c in candidates if fits(c)]
        if ids:
            return min(ids, key=lambda s: (load[s], s))
    return None


class Router:
    """The tokenizer's side: which stream each schedule job goes to."""

    def __init__(self, redis: Redis, keys: Keys, model: str, *, heartbeat_ttl_s: float, policy: Policy,
                 tokenizer_id: str = "tokenizer"):
        self.redis, self.keys, self.model, self.id = redis, keys, model, tokenizer_id
        self.ttl, self.policy = heartbeat_ttl_s, policy
        self.ttl_ms = int(heartbeat_ttl_s * 1000)
        self.candidates: list[Candidate] = []
        self.sent: dict[str, list[float]] = {}  # when this tokenizer routed a job to each scheduler
        # LoRA adapters this tokenizer sent to a scheduler that did not hold them, and when: counted as held there
        # (its slot taken) for a heartbeat TTL, while it loads them and until its heartbeats say so
        self.assigned: dict[str, dict[str, float]] = {}

    async def refresh(self) -> None:
        """The model's live schedulers that publish their pages, with their load (from their heartbeats)."""
        self.candidates = [
            Candidate(w.id, int(w.load.get("prefix_page_size") or 0),
                      float(w.load.get("running", 0)) + float(w.load.get("waiting", 0)), w.updated_at,
                      frozenset(a.rpartition("@")[0] or a for a in w.load.get("lora_adapters", ())),
                      max(0, int(w.load.get("lora_slots", 0)) - int(w.load.get("lora_resident", 0))))
            for w in await live_workers(self.redis, self.keys, self.ttl, role="scheduler")
            if w.model == self.model and w.load.get("prefix_page_size")]
        self._with_assigned(time.time())
        beats = {c.id: c.beat_at for c in self.candidates}
        self.sent = {sid: [t for t in times if t > beats[sid]] for sid, times in self.sent.items() if sid in beats}

    def on_beat(self, pipe: Any) -> None:
        """Heartbeat hook: the model's routing flag, which tells its schedulers to join (`SchedulerLanes`), set
        for as long as this tokenizer's heartbeat lives."""
        pipe.set(self.keys.prefix_routing(self.model), self.id, px=self.ttl_ms)

    def load(self, c: Candidate) -> float:
        """Its load at its last heartbeat plus the jobs routed to it since, which that beat could not count
        (some may have ended since: an estimate on the safe side until the next beat)."""
        return c.load + sum(t > c.beat_at for t in self.sent.get(c.id, ()))

    def loads_now(self, own: dict[str, int]) -> dict[str, float]:
        """Per scheduler, the more of its load at its last heartbeat and the jobs of its own stream not finished
        now (`own`, read with the pages): what it runs and queues, without `load`'s count of routed jobs that
        may have ended since the beat, which a bound on skew would take for a backlog."""
        return {c.id: max(c.load, own.get(c.id, 0)) for c in self.candidates}

    async def route(self, jobs: Sequence[Any]) -> list[str | None]:
        """Per job (anything with `input_ids`), the id of the scheduler whose own stream it goes to, or None for
        the shared stream. One pipelined round trip for the whole batch."""
        if not self.candidates or not jobs:
            return [None] * len(jobs)
        if any(getattr(j, "adapter", None) for j in jobs):
            return await self._route_adapters(jobs)
        return await self._route_prefixes(jobs)

    async def _route_adapters(self, jobs: Sequence[Any]) -> list[str | None]:
        """Jobs with a LoRA adapter by `choose_for_adapter` (a scheduler it sends one to counts as holding it from
        then on), the others by their prefixes."""
        plain = [j for j in jobs if not getattr(j, "adapter", None)]
        by_prefix = iter(await self._route_prefixes(plain) if plain else [])
        load = {c.id: self.load(c) for c in self.candidates}
        now, out = time.time(), []
        for job in jobs:
            if not getattr(job, "adapter", None):
                out.append(next(by_prefix))
                continue
            target = choose_for_adapter(job.adapter, self.candidates, load)
            if target is not None:
                load[target] += 1
                self.sent.setdefault(target, []).append(now)
                self._now_holds(target, job.adapter)
            log.debug("uid=%s adapter %s: %s", getattr(job, "uid", "?"), job.adapter, target or "shared stream")
            out.append(target)
        return out

    def _now_holds(self, scheduler: str, adapter: str) -> None:
        if not any(c.id == scheduler and adapter in c.adapters for c in self.candidates):
            self.assigned.setdefault(scheduler, {})[adapter] = time.time()
            self._with_assigned(time.time())

    def _with_assigned(self, now: float) -> None:
        """The candidates as their heartbeats say, plus the adapters assigned to them within a heartbeat TTL."""
        self.assigned = {sid: {a: t for a, t in got.items() if now - t < self.ttl}
                         for sid, got in self.assigned.items()}
        for i, c in enumerate(self.candidates):
            new = set(self.assigned.get(c.id, ())) - c.adapters
            if new:
                self.candidates[i] = replace(c, adapters=c.adapters | new, free_slots=max(0, c.free_slots - len(new)))

    async def _route_prefixes(self, jobs: Sequence[Any]) -> list[str | None]:
        pages = {ps: [prompt_pages(j.input_ids, ps, getattr(j, "cache_salt", "")) for j in jobs]
                 for ps in {c.page_size for c in self.candidates}}
        unique = {ps: list(dict.fromkeys(d for job in per_job for d in job)) for ps, per_job in pages.items()}
        asked = [c for c in self.candidates if unique[c.page_size]]
        if not asked:
            return [None] * len(jobs)
        async with self.redis.pipeline(transaction=False) as pipe:
            for c in asked:
                pipe.smismember(self.keys.cached_pages(self.model, c.id), unique[c.page_size])
            for c in self.candidates:
                streams.queue_groups(pipe, self.keys.scheduler_stream(self.model, c.id))
            replies = await pipe.execute(raise_on_error=False)
        for r in replies[:len(asked)]:
            if isinstance(r, Exception):
                raise r
        held = {c.id: {d for d, hit in zip(unique[c.page_size], r, strict=True) if hit}
                for c, r in zip(asked, replies, strict=False)}
        load = self.loads_now({c.id: streams.unfinished(r, SCHEDULER_GROUP)
                               for c, r in zip(self.candidates, replies[len(asked):], strict=True)})
        now = time.time()
        out: list[str | None] = []
        for i in range(len(jobs)):
            cached = {c.id: leading(pages[c.page_size][i], held.get(c.id, set())) * c.page_size
                      for c in self.candidates}
            target = choose(cached, load, self.policy.load_tokens, self.policy.max_skew)
            log.debug("uid=%s cached tokens %s, load %s: %s", getattr(jobs[i], "uid", "?"), cached, load,
                      target or "shared stream")
            if target is not None:
                load[target] += 1
                self.sent.setdefault(target, []).append(now)
            out.append(target)
        return out


def leading(pages: list[str], held: set[str]) -> int:
    """How many of the first pages are held, up to the first that is not (a later page names a longer prefix
    through it, so it cannot be read without the ones before)."""
    n = 0
    for d in pages:
        if d not in held:
            break
        n += 1
    return n
