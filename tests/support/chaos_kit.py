"""Chaos machinery shared by tests/e2e/test_chaos.py and bench/soak.py, against real processes (a `Stack`).

- `Clients`: streaming chat requests (rsinfer/sse_client.py) that record text per choice, event ids and chunk
  times; when the API process of a `background` request dies mid-stream they reattach to another one with
  Last-Event-ID (or resubmit, when the stream broke before its first chunk gave them the request's id).
- `ReplyRecorder`: a process that reads every entry of every new request's reply stream as it is written,
  before the reply-stream cap (MAXLEN) trims it, so that whole replies can be checked afterwards.
- `deliverable`: what the API would deliver from those entries, applying epoch fencing, and every token index
  two surviving entries disagree on.
- `Chaos`: the disruptions (SIGSTOP until a peer took work over, past the claim idle time, then SIGCONT; SIGKILL
  and a replacement; an API restart), each struck the moment its target holds work, with its victims (the
  requests the process held, from the group's pending list) and the replacement's time from spawn to heartbeat.
- `afterwards_problems`: what must hold once the run is over (empty pending lists, no consumer of a dead
  process, a TTL on every per-request key, every KV page free).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import multiprocessing
import re
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx
import redis
import redis.asyncio as aioredis

from rsinfer.launcher import api_ready
from rsinfer.sse_client import Reply, Request, stream
from shared.keys import DETOKENIZER_GROUP, SCHEDULER_GROUP, STAGES, TOKENIZER_GROUP, Keys
from tests.support.helpers import async_wait_for, wait_for, worker_name, workers
from tests.support.stack import MODEL, Stack

GROUPS = {"tokenizer": TOKENIZER_GROUP, "scheduler": SCHEDULER_GROUP, "detokenizer": DETOKENIZER_GROUP}
HANDOFF = "handoff"  # shared/worker.py HANDOFF_CONSUMER: not a process; entries handed back wait there
# Deadlines, not paces: a disruption is struck the moment its target holds work (within HOLD_WITHIN_S, else anyway,
# and the run's checks name it), and a frozen scheduler is let go once a peer took one of its requests over.
HOLD_WITHIN_S = 30.0
TAKEN_WITHIN_S = 60.0


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


# ---- requests and the clients that stream them


@dataclass(frozen=True)
class Job:
    """One chat request of a run: greedy (temperature 0), seeded (0.8 and a seed of its own) or unseeded (0.8)."""

    key: int
    kind: str
    n: int
    max_tokens: int
    api: int  # index of the API process it is first sent to
    background: bool
    timeout: float  # the request's own deadline (seconds), sent as `timeout`

    def body(self, stream: bool = True) -> dict:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"chaos request {self.key}"}],
                "max_tokens": self.max_tokens, "ignore_eos": True, "n": self.n, "stream": stream,
                "temperature": 0 if self.kind == "greedy" else 0.8, "timeout": self.timeout}
        if self.kind == "seeded":
            body["seed"] = 7919 * self.key + 1
        if self.background and stream:
            body["background"] = True
        return body


@dataclass
class Outcome:
    job: Job
    reply: Reply = field(default_factory=Reply)  # what its streams delivered (a reattach carries it on)
    errors: list[str] = field(default_factory=list)
    reattached: int = 0
    resubmitted: int = 0  # its API died before the first chunk told the request's id: sent again
    rerouted: int = 0  # its API was down when sent: sent to another, as a load balancer would
    ended: float = 0.0

    @property
    def started(self) -> float:
        return self.reply.sent

    @property
    def texts(self) -> list[str]:
        return self.reply.texts + [""] * (self.job.n - len(self.reply.texts))

    @property
    def finish(self) -> list[str | None]:
        return self.reply.finish + [None] * (self.job.n - len(self.reply.finish))

    @property
    def uid(self) -> str | None:
        return self.reply.uid

    @property
    def last_event(self) -> str | None:
        return self.reply.ids[-1] if self.reply.ids else None

    @property
    def done(self) -> bool:
        """`data: [DONE]` seen."""
        return self.reply.done

    @property
    def times(self) -> list[float]:
        """time.time() of every chunk."""
        return [self.reply.wall(t) for t in self.reply.arrivals]

    @property
    def complete(self) -> bool:
        return self.done and not self.errors and self.finish == ["length"] * self.job.n

    @property
    def max_gap(self) -> float:
        """The longest wait between consecutive chunks, the wait for the first one included (seconds)."""
        marks = [self.started, *self.times]
        return max((b - a for a, b in itertools.pairwise(marks)), default=0.0)

    def record(self) -> dict:
        """What the client saw, as JSON."""
        return {"job": vars(self.job), "started": self.started, "texts": self.texts, "finish": self.finish,
                "uid": self.uid, "last_event": self.last_event, "times": self.times, "errors": self.errors,
                "reattached": self.reattached, "resubmitted": self.resubmitted, "rerouted": self.rerouted,
                "done": self.done, "ended": self.ended}

    def gap_at(self, at: float) -> float | None:
        """The wait that spans time `at` (time.time()): from the last chunk before it (or the submission) to
        the first one after it; None if the stream had ended by then or had not started."""
        times = self.times
        if at < self.started or (times and times[-1] < at):
            return None
        before = max((t for t in times if t < at), default=self.started)
        return min(t for t in times if t >= at) - before if times else None


class Clients:
    """Streams jobs through the API processes at `urls` (rsinfer/sse_client.py). New requests go around the
    ones in `unready` (a load balancer routes only to ready instances); one that refuses connections is left
    for another at once."""

    def __init__(self, urls: list[str]):
        self.urls = urls
        self.unready: set[int] = set()
        self.outcomes: list[Outcome] = []

    def _other(self, api: int) -> int:
        return (api + 1) % len(self.urls)

    async def run(self, job: Job) -> Outcome:
        out = Outcome(job)
        self.outcomes.append(out)
        api = job.api
        try:
            async with asyncio.timeout(job.timeout + 30):
                while not out.done and not out.errors:
                    api = await self._attempt(out, api)
        except TimeoutError:
            out.errors.append("no end within the request's deadline")
        out.ended = time.time()
        return out

    async def _attempt(self, out: Outcome, api: int) -> int:
        """One POST (no request id yet) or one reattach; returns the API process for the next attempt."""
        job = out.job
        if out.reattached + out.resubmitted + out.rerouted > 8:
            out.errors.append("gave up after 8 reattaches, resubmissions or reroutes")
            return api
        if out.uid is None:
            if api in self.unready and len(self.unready) < len(self.urls):
                api = self._other(api)
            failure = await self._stream(out, Request(self.urls[api], job.body(), "/v1/chat/completions"))
            if failure == "connect":
                out.rerouted += 1
                await asyncio.sleep(0.2)
                return self._other(api)
            # else the stream ended, or the API process died mid-stream
            if out.done or out.errors:
                return api
            if not job.background:
                out.errors.append("the stream of a non-background request broke")
            elif out.uid is None:
                out.resubmitted += 1  # the orphan runs to its end in the background; nobody reads it
            return self._other(api)
        out.reattached += 1
        headers = {"Last-Event-ID": out.last_event} if out.last_event else {}
        if await self._stream(out, Request(self.urls[api], path=f"/v1/requests/{out.uid}/stream", method="GET",
                                           headers=headers)):
            await asyncio.sleep(0.2)
        return api if out.done else self._other(api)

    async def _stream(self, out: Outcome, request: Request) -> str:
        """Stream into the outcome's reply (a connection quiet for 30 s has failed); what the transport did wrong
        ("" if nothing). A refusal or an error event is one of the outcome's errors."""
        reply = await stream(dataclasses.replace(request, idle_timeout=30), out.reply)
        if reply.failure:
            return reply.failure
        if reply.status != 200:
            out.errors.append(f"{request.method} {request.url}{request.path}: {json.dumps(reply.error)[:300]}")
        elif reply.error is not None:
            out.errors.append(json.dumps(reply.error)[:300])
        return ""


async def reference_texts(url: str, jobs: list[Job]) -> dict[int, list[str]]:
    """Each job's texts per choice from an undisturbed, non-streamed run (job key -> texts)."""
    async with httpx.AsyncClient(timeout=300) as http:
        async def one(job: Job) -> tuple[int, list[str]]:
            resp = await http.post(f"{url}/v1/chat/completions", json=job.body(stream=False))
            assert resp.status_code == 200, resp.text
            choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
            assert [c["finish_reason"] for c in choices] == ["length"] * job.n
            return job.key, [c["message"]["content"] for c in choices]

        return dict(await asyncio.gather(*(one(j) for j in jobs)))


# ---- reply streams: recorded whole, and what the API would deliver from them


class ReplyRecorder:
    """Follows the reply stream of every request made after it started (found by their records, which exist
    before any reply entry) with XREAD from the first entry, and keeps every entry, so that entries the
    reply-stream cap trims later are still checked. It runs as a process of its own: the clients' event loop
    being busy must not make it fall behind the trimming (`missing()` says whether it did)."""

    def __init__(self, stack: Stack, out: Path):
        self.stack, self.out = stack, out
        ctx = multiprocessing.get_context("fork")  # started before any event loop or thread of ours
        self.stopping, self.ready = ctx.Event(), ctx.Event()
        self.proc = ctx.Process(target=_record, args=(stack.redis_url, stack.namespace, str(out), self.stopping,
                                                      self.ready), daemon=True, name="reply-recorder")
        self.entries: dict[str, list[tuple[str, dict]]] = {}  # uid -> [(entry id, decoded data)]

    def start(self) -> None:
        self.proc.start()
        if not self.ready.wait(30):
            raise RuntimeError("the reply recorder did not start")

    def finish(self) -> None:
        """Stop following, read what is left of every stream, and load what was recorded."""
        self.stopping.set()
        self.proc.join(60)
        if self.proc.exitcode != 0:
            raise RuntimeError(f"the reply recorder failed ({self.proc.exitcode})")
        recorded = json.loads(self.out.read_text())
        self.entries = {uid: [(eid, json.loads(data)) for eid, data in items] for uid, items in recorded.items()}

    def close(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()

    def missing(self) -> dict[str, int]:
        """uid -> entries written to its stream that the recorder never saw (it fell behind the trimming)."""
        r, out = self.stack.redis(), {}
        for uid, seen in self.entries.items():
            with contextlib.suppress(redis.ResponseError):
                added = r.xinfo_stream(self.stack.keys.reply(uid))["entries-added"]
                if added != len(seen):
                    out[uid] = added - len(seen)
        return out

    def trimmed(self) -> int:
        """Streams the reply-stream cap has trimmed (their first entry is gone)."""
        r, count = self.stack.redis(), 0
        for uid in self.entries:
            with contextlib.suppress(redis.ResponseError):
                key = self.stack.keys.reply(uid)
                count += r.xinfo_stream(key)["entries-added"] > r.xlen(key)
        return count


def _record(url: str, namespace: str, out: str, stopping, ready) -> None:
    """The recorder process: new requests' reply streams, every entry as written, to `out` (JSON) at the end."""
    follower = _ReplyFollower(redis.Redis.from_url(url, decode_responses=True), Keys(namespace))
    ready.set()
    discovered = 0.0
    while not stopping.is_set():
        try:
            if time.monotonic() - discovered > 0.1:
                follower.discover()
                discovered = time.monotonic()
            follower.read()
        except (redis.RedisError, OSError):
            time.sleep(0.2)  # Redis restarting
    follower.discover()
    follower.read_rest()
    Path(out).write_text(json.dumps(follower.entries))


class _ReplyFollower:
    """The reply streams of the requests made after it was created, and every entry read from them."""

    def __init__(self, r: redis.Redis, keys: Keys):
        self.r, self.keys = r, keys
        self.known = set(r.scan_iter(match=keys.request("*"), count=1000))  # made before the run: not followed
        self.positions: dict[str, str] = {}
        self.entries: dict[str, list[tuple[str, str]]] = {}
        self.uid_of: dict[str, str] = {}  # reply stream key -> uid

    def discover(self) -> None:
        for key in self.r.scan_iter(match=self.keys.request("*"), count=1000):
            if key not in self.known:
                self.known.add(key)
                uid = self.keys.uid_of_request_key(key)
                self.positions[self.keys.reply(uid)] = "0-0"
                self.uid_of[self.keys.reply(uid)] = uid
                self.entries[uid] = []

    def read(self) -> None:
        """New entries of every stream followed (one XREAD, blocking 50 ms)."""
        if not self.positions:
            return
        for key, items in self.r.xread(dict(self.positions), count=1000, block=50) or []:
            self.keep(key, items)

    def read_rest(self) -> None:
        for key, last in self.positions.items():
            self.keep(key, self.r.xrange(key, f"({last}" if last != "0-0" else "-", "+"))

    def keep(self, key: str, items: list) -> None:
        self.entries[self.uid_of[key]].extend((eid, fields["data"]) for eid, fields in items)
        if items:
            self.positions[key] = items[-1][0]


@dataclass
class Delivered:
    """What the API would deliver from one reply stream, and what is wrong with the stream."""

    texts: list[str]
    finish: list[str | None]
    ends: list[int]
    conflicts: list[str]  # "choice:index" that surviving entries give two different tokens
    refused: int = 0  # entries below a fence's epoch: never delivered
    stale_disagreeing: int = 0  # refused entries whose tokens differ from the surviving ones
    overlaps: int = 0  # surviving ranges dropped because they overlap what was delivered (not step-aligned)
    errors: list[dict] = field(default_factory=list)
    kinds: Counter = field(default_factory=Counter)


def deliverable(entries: list[dict], n: int) -> Delivered:
    """Apply fencing as shared/reply_order.py's OrderedReplies does: an entry whose `epoch` is below that of a
    fence, or of any entry, before it in the stream is stale and refused (entries without an epoch are epoch
    0), and when the epoch rises the ranges of an older one still held behind a gap are forgotten (the successor
    resumed from what lay before the gap). Then each choice's ranges are delivered in token order: early ones
    held, delivered ones dropped. Two different tokens for one index among the entries not stale are conflicts."""
    out = Delivered([""] * n, [None] * n, [0] * n, [])
    order = _Order(out)
    surviving, stale, epoch = [], [], 0
    for e in entries:
        kind = e.get("kind", "?")
        out.kinds[kind] += 1
        ep = int(e.get("epoch") or 0)
        if ep < epoch:
            out.refused += kind in ("delta", "error")
            stale.append(e)
            continue
        if ep > epoch:
            forgotten = order.forget_below(ep)
            out.refused += len(forgotten)
            stale += forgotten
            surviving = [x for x in surviving if not any(x is f for f in forgotten)]
            epoch = ep
        if kind == "delta":
            surviving.append(e)
            order.accept(e)
        elif kind == "error":
            out.errors.append(e)
    tokens = _tokens(surviving, out.conflicts)
    out.stale_disagreeing = sum(1 for e in stale if any(
        tokens.get((e.get("index", 0), e["start"] + k), t) != t for k, t in enumerate(e.get("ids") or [])))
    return out


def _tokens(events: list[dict], conflicts: list[str]) -> dict[tuple[int, int], int]:
    seen: dict[tuple[int, int], int] = {}
    for e in events:
        ids = e.get("ids") or []
        if len(ids) != e["end"] - e["start"]:
            conflicts.append(f"{e.get('index', 0)}:[{e['start']},{e['end']}) carries {len(ids)} ids")
            continue
        for k, tok in enumerate(ids):
            at = (e.get("index", 0), e["start"] + k)
            if seen.setdefault(at, tok) != tok:
                conflicts.append(f"{at[0]}:{at[1]} {seen[at]}!={tok}")
    return seen


class _Order:
    """One reply stream's choices delivered in token order (as OrderedReplies)."""

    def __init__(self, out: Delivered):
        self.out, n = out, len(out.texts)
        self.held: list[dict[int, dict]] = [{} for _ in range(n)]
        self.done: set[int] = set()

    def forget_below(self, epoch: int) -> list[dict]:
        gone = []
        for held in self.held:
            for start in [s for s, e in held.items() if int(e.get("epoch") or 0) < epoch]:
                gone.append(held.pop(start))
        return gone

    def _advance(self, e: dict) -> None:
        i, out = e.get("index", 0), self.out
        out.texts[i] += e.get("text", "")
        out.ends[i] = max(out.ends[i], e["end"])
        if e.get("finish_reason"):
            out.finish[i] = e["finish_reason"]
            self.done.add(i)

    def accept(self, e: dict) -> None:
        i, out = e.get("index", 0), self.out
        if not 0 <= i < len(out.texts) or i in self.done:
            return
        if e.get("finish_reason") and not e.get("ids") and e["start"] <= out.ends[i]:
            out.finish[i] = e["finish_reason"]
            self.done.add(i)
        elif e["end"] < out.ends[i] or (e["end"] == out.ends[i] and not e.get("finish_reason")):
            return  # already delivered
        elif e["start"] > out.ends[i]:
            self.held[i][e["start"]] = e
        elif e["start"] < out.ends[i]:
            out.overlaps += 1
        else:
            self._advance(e)
            while i not in self.done and (nxt := self.held[i].pop(out.ends[i], None)) is not None:
                self._advance(nxt)


# ---- disruptions


@dataclass
class Disruption:
    kind: str  # "stop", "kill" or "api_restart"
    role: str
    target: str
    at: float  # time.time()
    victims: list[str]  # uids the process held
    replacement: str | None = None
    restart_s: float | None = None  # spawn of the replacement to its heartbeat (API: to /ready)
    taken: list[str] = field(default_factory=list)  # stop: victims a peer took over while it was frozen
    up: asyncio.Event = field(default_factory=asyncio.Event)  # set with restart_s


class Chaos:
    """Disrupts the processes of `stack` and notes what each disruption hit. Blocking calls run in threads."""

    def __init__(self, stack: Stack, env: dict[str, str], api_ports: list[int]):
        self.stack, self.env, self.api_ports = stack, env, api_ports
        self.redis = aioredis.from_url(stack.redis_url, decode_responses=True)
        self.events: list[Disruption] = []
        self.spawned: Counter = Counter()
        self._watchers: list[asyncio.Task] = []

    def names(self, role: str) -> list[str]:
        """Running processes of a role (names as started: `<role><n>`, APIs `api<k>` or `api<k>-r<m>`)."""
        return [n for n in self.stack.procs if re.fullmatch(rf"{role}\d+(-r\d+)?", n)]

    async def held_uids(self, role: str, name: str) -> list[str]:
        """Requests whose entries the process `name` holds in its group's pending list."""
        key, group = self.stack.keys.stage_stream(role, MODEL), GROUPS[role]
        try:
            consumers = [c["name"] for c in await self.redis.xinfo_consumers(key, group)]
        except redis.ResponseError:
            return []
        uids: set[str] = set()
        for cid in (c for c in consumers if worker_name(c) == name):
            for row in await self.redis.xpending_range(key, group, "-", "+", 1000, consumername=cid):
                for _, fields in await self.redis.xrange(key, row["message_id"], row["message_id"]):
                    data = json.loads(fields["data"])
                    uids.update([data["uid"]] if "uid" in data else [it["uid"] for it in data.get("items", [])])
        return sorted(uids)

    async def stop(self, role: str, names: list[str]) -> Disruption:
        """SIGSTOP the first of `names` to hold requests (within HOLD_WITHIN_S; else the first, holding none),
        until a peer has taken one of them over (it stayed frozen past the claim idle time; within
        TAKEN_WITHIN_S), then SIGCONT: it goes on with stale work, which fencing must refuse."""
        name = await asyncio.to_thread(self.freeze_first_holding, role, names, HOLD_WITHIN_S) or names[0]
        proc = self.stack.procs[name]
        proc.send_signal(signal.SIGSTOP)
        event = Disruption("stop", role, name, time.time(), await self.held_uids(role, name))
        self.events.append(event)

        async def taken() -> list[str]:
            event.taken = sorted(set(event.victims) - set(await self.held_uids(role, name)))
            return event.taken

        try:
            with contextlib.suppress(TimeoutError):  # the run's checks say which stop no peer took over
                if event.victims:
                    await async_wait_for(taken, timeout=TAKEN_WITHIN_S, every=0.1)
        finally:
            proc.send_signal(signal.SIGCONT)
        return event

    def freeze_first_holding(self, role: str, names: list[str], timeout: float) -> str | None:
        """SIGSTOP the first of `names` seen holding an entry of its group (checked again once frozen); None if
        none did within `timeout`. For schedulers, which hold an entry from admission to the request's end."""
        r, key, group = self.stack.redis(), self.stack.keys.stage_stream(role, MODEL), GROUPS[role]

        def holding() -> dict[str, int]:
            with contextlib.suppress(redis.ResponseError):
                found = {worker_name(c["name"]): c["pending"] for c in r.xinfo_consumers(key, group)}
                return {n: found[n] for n in names if found.get(n)}
            return {}

        def frozen_holding() -> str | None:
            held = holding()
            for name in sorted(held, key=held.__getitem__, reverse=True):  # the busiest first
                self.stack.procs[name].send_signal(signal.SIGSTOP)
                if name in holding():
                    return name
                self.stack.procs[name].send_signal(signal.SIGCONT)
            return None

        try:
            return wait_for(frozen_holding, timeout=timeout)
        except TimeoutError:
            return None

    def freeze_once_holding(self, role: str, name: str, timeout: float) -> bool:
        """SIGSTOP `name` holding an entry of its group; False if it held none within `timeout`. Polling a running
        worker misses the few milliseconds between a read and its acknowledgement on a loaded machine, so it is
        frozen first and let run a couple of milliseconds at a time: an entry that arrives while it is frozen
        in its blocking XREADGROUP, or that it reads in one of those slices, is pending in its name."""
        r, key, group = self.stack.redis(), self.stack.keys.stage_stream(role, MODEL), GROUPS[role]
        proc = self.stack.procs[name]

        def holds() -> bool:
            with contextlib.suppress(redis.ResponseError):
                return any(worker_name(c["name"]) == name and c["pending"] for c in r.xinfo_consumers(key, group))
            return False

        def holds_after_a_slice() -> bool:
            proc.send_signal(signal.SIGCONT)
            time.sleep(0.002)  # the slice it runs for: the mechanism, not a wait for something
            proc.send_signal(signal.SIGSTOP)
            return holds()

        proc.send_signal(signal.SIGSTOP)
        if holds():
            return True
        try:
            return wait_for(holds_after_a_slice, timeout=timeout, every=0.01)
        except TimeoutError:
            return False

    async def kill_holding(self, role: str, name: str) -> Disruption:
        """Freeze a stage worker the moment it holds entries (it will never finish them; within HOLD_WITHIN_S),
        then kill it."""
        await asyncio.to_thread(self.freeze_once_holding, role, name, HOLD_WITHIN_S)
        return await self.kill(role, name)

    async def kill(self, role: str, name: str) -> Disruption:
        """SIGKILL a stage worker, then start a replacement under a new name."""
        victims = await self.held_uids(role, name)
        at = time.time()
        await asyncio.to_thread(self.stack.kill, name)
        event = Disruption("kill", role, name, at, victims)
        self.events.append(event)
        self.spawned[role] += 1
        event.replacement = f"{role}{10 + self.spawned[role]}"  # started ones are <role>1..9
        self.stack.start(event.replacement, role, **self.env)
        self._watchers.append(asyncio.create_task(self._time_restart(event, time.monotonic())))
        return event

    async def restart_api(self, index: int, victims: list[str]) -> Disruption:
        """SIGKILL API process `index` and start another on its port (`victims`: requests it was streaming)."""
        [name] = [n for n in self.names("api") if n == f"api{index + 1}" or n.startswith(f"api{index + 1}-")]
        at = time.time()
        await asyncio.to_thread(self.stack.kill, name)
        self.spawned["api"] += 1
        event = Disruption("api_restart", "api", name, at, victims,
                           replacement=f"api{index + 1}-r{self.spawned['api']}")
        self.events.append(event)
        self.stack.start(event.replacement, "api", RSINFER_PORT=str(self.api_ports[index]), **self.env)
        url = f"http://127.0.0.1:{self.api_ports[index]}"
        self._watchers.append(asyncio.create_task(self._time_restart(event, time.monotonic(), url)))
        return event

    async def _time_restart(self, event: Disruption, spawned: float, url: str = "") -> None:
        """Until the replacement is up (its heartbeat; an API's /ready), or killed in turn before it was."""
        member = f"{event.role}:{event.replacement}"
        while time.monotonic() - spawned < 300 and event.replacement in self.stack.procs:
            if url:
                up = await asyncio.to_thread(api_ready, url)
            else:
                members = await self.redis.zrange(self.stack.keys.workers(), 0, -1)
                up = any(m == member or m.startswith(f"{member}@") for m in members)
            if up:
                event.restart_s = time.monotonic() - spawned
                event.up.set()
                return
            await asyncio.sleep(0.1)

    async def settle(self) -> None:
        """Wait until every replacement is up (or its watcher gave up)."""
        await asyncio.gather(*self._watchers, return_exceptions=True)

    async def close(self) -> None:
        for task in self._watchers:
            task.cancel()
        await self.redis.aclose()


# ---- after the run


def afterwards_problems(stack: Stack) -> dict[str, list]:
    """What must hold once every request ended: every group's pending list empty, no consumer of a dead process
    (only live workers' ids), every per-request key with a TTL, every live scheduler idle with all pages free."""
    r = stack.redis()
    problems: dict[str, list] = {}
    for role in STAGES:
        key, group = stack.keys.stage_stream(role, MODEL), GROUPS[role]
        pending = r.xpending(key, group)["pending"]
        if pending:
            problems.setdefault("pending", []).append(f"{group}: {pending}")
        live = {w.id for w in workers(stack, role)}
        dead = [c["name"] for c in r.xinfo_consumers(key, group)
                if c["name"] not in live and not (c["name"] == HANDOFF and c["pending"] == 0)]
        if dead:
            problems.setdefault("dead_consumers", []).append(f"{group}: {sorted(dead)}")
    for pattern in (stack.keys.request("*"), stack.keys.reply("*"), stack.keys.abort("*")):
        for k in r.scan_iter(match=pattern, count=1000):
            if r.ttl(k) < 0 and r.exists(k):  # -1: no TTL (-2: it expired meanwhile)
                problems.setdefault("no_ttl", []).append(k)
    loads = {w.id: w.load for w in workers(stack, "scheduler")}
    busy = {wid: {k: ld.get(k) for k in ("requests", "running", "waiting", "free_pages", "total_pages")}
            for wid, ld in loads.items()
            if ld.get("requests") or ld.get("running") or ld.get("waiting") or ld["free_pages"] != ld["total_pages"]}
    if busy or not loads:
        problems["schedulers_not_idle"] = [busy or "no live scheduler"]
    return problems


def settled_problems(stack: Stack, timeout: float) -> dict[str, list]:
    """afterwards_problems once they are gone, or as they stand after `timeout` seconds (housekeeping, heartbeat
    TTLs and the last acknowledgements get that long)."""
    deadline = time.monotonic() + timeout
    while True:
        problems = afterwards_problems(stack)
        if not problems or time.monotonic() > deadline:
            return problems
        time.sleep(0.5)


# ---- worker logs


LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def log_counts(log_dir: Path) -> dict[str, int]:
    """Lines of interest in every process's log: takeovers (a scheduler resuming a request, any worker claiming
    a peer's entries), a stalled scheduler finding its request taken over, and what API or detokenizer
    processes say about epochs or stale output."""
    counts: Counter = Counter()
    for path in log_dir.glob("*.log"):
        role = re.sub(r"\d.*", "", path.stem)
        for line in path.read_text(errors="replace").splitlines():
            if "resumed after" in line:
                counts["scheduler_resumed"] += 1
            if re.search(r"\bclaimed\b", line):
                counts[f"{role}_claim_lines"] += 1
            if "taken over" in line or "taken_over" in line:
                counts["taken_over_lines"] += 1
            if role in ("api", "detokenizer") and re.search(r"epoch|stale|fenc", line, re.IGNORECASE):
                counts[f"{role}_epoch_lines"] += 1
    return dict(counts)


def log_times(log_dir: Path, pattern: str, role: str) -> list[float]:
    """Unix times of the log lines of `role`'s processes matching `pattern`."""
    out = []
    for path in log_dir.glob(f"{role}*.log"):
        for line in path.read_text(errors="replace").splitlines():
            m = LOG_TIME.match(line)
            if m and re.search(pattern, line):
                out.append(datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp())
    return sorted(out)
