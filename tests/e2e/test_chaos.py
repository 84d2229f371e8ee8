"""Chaos at scale (issue 10): 3 schedulers, 2 tokenizers, 2 detokenizers and 2 API processes serve 100
concurrent streams (greedy, seeded and unseeded sampling, some with n=2, some past the reply-stream cap) while
schedulers are frozen past the claim idle time and resumed, a worker of every stage is killed and replaced, and
an API process is killed and restarted (its clients, whose requests run in the background, reattach to the
other one with Last-Event-ID). Each disruption is struck the moment its target holds work (no pacing by the
clock), so every one of them hits requests however loaded the machine is, and a frozen scheduler is let go once
a peer has taken one of its requests over. Then:

- every request completes; greedy and seeded texts equal those of an undisturbed run exactly;
- no reply stream, read whole as it was written, holds two different tokens for one index of a choice among
  the entries the API delivers (entries below a fence's epoch are refused), and every client's text is exactly
  what those entries deliver, in order and with no gap (so an unseeded text is one consistent sequence);
- afterwards every group's pending list is empty, no consumer of a dead process remains, every per-request key
  has a TTL and every scheduler has all its KV pages free.

Fencing as the checks read it: every reply entry may carry an `epoch` (none = 0); an entry whose epoch is below
that of an entry before it in the stream (a `fence`, or any other) is stale and never delivered. Entries of kinds
other than `delta` and `error` (fences, checkpoints) deliver nothing.

The figures (requests, kills, stops, takeovers, refused entries, time to resume p50/p99) are printed and written
to chaos.json in the test's tmp dir, next to replies.json (every recorded reply entry) and outcomes.json (what
each client saw). RSINFER_CHAOS_LONG=1 runs 320 requests under disruptions repeated until they end and writes
bench/results/chaos.json.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.support.chaos_kit import (
    HOLD_WITHIN_S,
    Chaos,
    Clients,
    Delivered,
    Disruption,
    Job,
    Outcome,
    ReplyRecorder,
    deliverable,
    log_counts,
    percentile,
    reference_texts,
    settled_problems,
)
from tests.support.helpers import async_wait_for, engines_idle, live_names, wait_for, workers
from tests.support.stack import LIFECYCLE_ENV, Stack, new_stack, start_replicas

LONG = os.environ.get("RSINFER_CHAOS_LONG") == "1"
pytestmark = [pytest.mark.timeout(3600 if LONG else 300), pytest.mark.slow]  # `make test-fast` leaves it out

# Entries: a 300-token reply of two choices (about one entry per token per choice) goes well past it, while a
# client whose API process died finds its Last-Event-ID still there when it reattaches a second or two later
# (else: 410 reply_trimmed), and the recorder, a process of its own on 2 busy cores, reads every entry before
# it is trimmed (a second's lag or more).
REPLY_MAXLEN = 300
# Eight running requests per scheduler: most of the 100 streams wait their turn, so work is in flight throughout.
# No reasoning or tool-call parsing: the demo model samples `<think>` (and `</think>`) like any token, and a chat
# answer that starts with one would go to reasoning_content, not the text the clients compare.
ENV = {**LIFECYCLE_ENV, "RSINFER_REPLY_MAXLEN": str(REPLY_MAXLEN), "RSINFER_MAX_RUNNING": "8",
       "RSINFER_REASONING_PARSER": "none", "RSINFER_TOOL_CALL_PARSER": "none"}
KINDS = ("greedy", "seeded", "unseeded")
ROOT = Path(__file__).resolve().parents[2]


def make_jobs(keys: range, timeout: float) -> list[Job]:
    """The mix: kinds in turn, n=2 for one in five, one in four 300 tokens long (past the cap), the rest 40-139;
    two in seven through the second API process, all of those in the background (that process is the one
    restarted), and some of the first API's too."""
    return [Job(key=k, kind=KINDS[k % 3], n=2 if k % 5 == 1 else 1,
                max_tokens=300 if k % 4 == 0 else 40 + (k * 53) % 100, api=int(k % 7 in (2, 5)),
                background=k % 7 in (2, 5) or k % 6 == 0, timeout=timeout) for k in keys]


class Run:
    """One chaos run: clients and disruptions in one event loop, the reply recorder in a process (started at
    once: the requests made from then on are recorded)."""

    def __init__(self, s: Stack, ports: list[int], out: Path):
        self.s = s
        self.recorder = ReplyRecorder(s, out / "replies.json")
        self.recorder.start()
        self.clients = Clients([f"http://127.0.0.1:{p}" for p in ports])
        self.chaos = Chaos(s, ENV, ports)
        self.tasks: list[asyncio.Task] = []
        self.background: list[asyncio.Task] = []
        self.limit = asyncio.Semaphore(100)
        self.missing: dict[str, int] = {}  # uid -> reply entries the recorder never saw
        self.trimmed = 0  # reply streams the cap trimmed

    def submit(self, jobs: list[Job]) -> None:
        async def one(job: Job) -> Outcome:
            async with self.limit:
                return await self.clients.run(job)

        self.tasks += [asyncio.create_task(one(j)) for j in jobs]

    def in_flight(self) -> bool:
        return not all(t.done() for t in self.tasks)

    async def kill_tokenizer_holding_work(self, name: str, wave: list[Job]) -> Disruption:
        """Freeze the other tokenizers, let requests arrive (`wave`, when given), freeze `name` the moment it holds
        some and kill it; then let the others go on: the killed one's entries wait for a peer's claim."""
        others = [self.s.procs[n] for n in self.chaos.names("tokenizer") if n != name]
        for proc in others:
            proc.send_signal(signal.SIGSTOP)
        try:
            self.submit(wave)
            return await self.chaos.kill_holding("tokenizer", name)
        finally:
            for proc in others:
                proc.send_signal(signal.SIGCONT)

    def api_victims(self) -> list[str]:
        """Requests the second API process streams now: their first chunk told their id, and they go on."""
        return [o.uid for o in self.clients.outcomes if o.job.api == 1 and o.uid and not o.done]

    async def restart_second_api(self, least: int = 1) -> Disruption:
        """Kill the second API process the moment it streams `least` requests whose clients know their ids (else,
        after HOLD_WITHIN_S, one), and start another on its port. Those clients reattach to the other API with
        Last-Event-ID; a request held back before its first reply entry cannot be reattached: its client
        resubmits."""
        for at_least in sorted({least, 1}, reverse=True):
            with contextlib.suppress(TimeoutError):  # the run's checks name a disruption that hit nothing
                # polled: the streams get there in the clients' own tasks, which announce nothing
                await async_wait_for(lambda n=at_least: len(self.api_victims()) >= n or not self.in_flight(),
                                     timeout=HOLD_WITHIN_S)
                break
        self.clients.unready.add(1)
        event = await self.chaos.restart_api(1, self.api_victims())

        async def back_when_ready() -> None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.up.wait(), 300)
            self.clients.unready.discard(1)

        self.background.append(asyncio.create_task(back_when_ready()))
        return event

    async def ci_disruptions(self, wave2: list[Job], wave3: list[Job]) -> None:
        """Each kind of disruption once and the scheduler freeze twice, each struck the moment its target holds
        work, one after the other while the streams are open (the API first: once its streams have begun, the
        first scheduler holds all it can run). The second freeze comes once the first is let go, with `wave3` sent
        just before it: some scheduler holds work then, however fast the rest went."""
        await self.restart_second_api(least=8)  # most of its requests come first: several reattach
        first_stop = asyncio.create_task(self.chaos.stop("scheduler", ["scheduler1"]))
        await self.kill_tokenizer_holding_work("tokenizer1", wave2)
        await self.chaos.kill_holding("scheduler", "scheduler2")
        await self.chaos.kill_holding("detokenizer", "detokenizer1")
        await first_stop
        self.submit(wave3)
        await self.chaos.stop("scheduler", await self.ready("scheduler") or self.chaos.names("scheduler"))

    async def long_disruptions(self) -> None:
        """The same disruptions in turn, on rotating targets, until every request has ended: each struck when its
        target holds work, the next once the last one's replacement is up (the pace is the recovery's)."""
        cycle = 0
        while self.in_flight():
            schedulers = await self.ready("scheduler") or self.chaos.names("scheduler")
            stopped = schedulers[cycle % len(schedulers)]
            stop = asyncio.create_task(self.chaos.stop("scheduler", [stopped]))
            for step in range(4):
                if not self.in_flight():
                    break
                if event := await self.long_step(step, cycle, stopped):
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(event.up.wait(), 120)
            await stop
            cycle += 1

    async def ready(self, role: str) -> list[str]:
        """Running processes of a role that are up (a replacement still starting holds nothing)."""
        live = set(await asyncio.to_thread(live_names, self.s, role))
        return sorted(n for n in self.chaos.names(role) if n in live)

    async def long_step(self, step: int, cycle: int, stopped: str) -> Disruption | None:
        """One disruption of a cycle; skipped when its stage has no other worker up yet."""
        if step == 0 and (tokenizers := await self.ready("tokenizer")):
            return await self.kill_tokenizer_holding_work(tokenizers[cycle % len(tokenizers)], [])
        if step == 1 and (schedulers := [n for n in await self.ready("scheduler") if n != stopped]):
            return await self.chaos.kill_holding("scheduler", schedulers[cycle % len(schedulers)])
        if step == 2 and (detokenizers := await self.ready("detokenizer")):
            return await self.chaos.kill_holding("detokenizer", detokenizers[cycle % len(detokenizers)])
        if step == 3:
            return await self.restart_second_api()
        return None

    def schedulers_caught_up(self, since: float) -> None:
        """Until every scheduler has beaten since `since` (the last one frozen was let go before it) and is idle:
        one let go late may still write what it had made before it noticed its requests were taken, and the
        recorder must see that too."""
        with contextlib.suppress(TimeoutError):  # what is left is reported as problems afterwards
            wait_for(lambda: _caught_up(self.s, since), timeout=15)

    async def run(self, jobs: list[Job], wave2: list[Job], wave3: list[Job]) -> float:
        began = time.monotonic()
        try:
            self.submit(sorted(jobs, key=lambda j: -j.api))  # the second API's first: streaming when it dies
            await (self.long_disruptions() if LONG else self.ci_disruptions(wave2, wave3))
            while self.in_flight():
                await asyncio.gather(*self.tasks)
            wall = time.monotonic() - began
            await self.chaos.settle()
            await asyncio.gather(*self.background)
            await asyncio.to_thread(self.schedulers_caught_up, time.time())
            await asyncio.to_thread(self.recorder.finish)
            self.missing, self.trimmed = self.recorder.missing(), self.recorder.trimmed()
            return wall
        finally:
            self.recorder.close()
            await self.chaos.close()


def _caught_up(s: Stack, since: float) -> bool:
    return all(w.updated_at > since for w in workers(s, "scheduler")) and engines_idle(s)


def check_outcomes(run: Run, reference: dict[int, list[str]]) -> tuple[dict[str, list], dict]:
    """Every request's failures against the spec, and the figures of its reply streams."""
    failures: dict[str, list] = {}
    figures = Counter()
    followed = set()
    for o in run.clients.outcomes:
        tag = f"{o.job.kind} n={o.job.n} max={o.job.max_tokens} key={o.job.key} uid={o.uid}"
        if not o.complete:
            failures.setdefault("incomplete", []).append(f"{tag}: done={o.done} finish={o.finish} {o.errors[:2]}")
        if o.job.kind != "unseeded" and o.texts != reference[o.job.key] and o.complete:
            failures.setdefault("differs_from_undisturbed", []).append(tag)
        if o.uid is None:
            continue
        followed.add(o.uid)
        got = check_stream(run, Expected(o.uid, o.job.n, o.job.max_tokens, tag), failures, figures)
        if got and o.complete and o.texts != got.texts:
            failures.setdefault("client_text_is_not_the_delivered_sequence", []).append(tag)
    for uid in run.recorder.entries.keys() - followed:  # resubmitted requests' orphans, run to their end
        record = run.s.redis().hgetall(run.s.keys.request(uid))
        expected = Expected(uid, int(record.get("n", 1)), int(record.get("max_tokens", 0)), f"orphan uid={uid}")
        check_stream(run, expected, failures, figures)
    return failures, dict(figures)


class Expected(NamedTuple):
    """What one request's reply stream must deliver: `n` choices of `max_tokens` tokens; `tag` names it."""

    uid: str
    n: int
    max_tokens: int
    tag: str


def check_stream(run: Run, expected: Expected, failures: dict[str, list], figures: Counter) -> Delivered | None:
    """The checks of one recorded reply stream; what it delivers."""
    uid, n, max_tokens, tag = expected
    if uid not in run.recorder.entries:
        failures.setdefault("not_recorded", []).append(tag)
        return None
    got = deliverable([e for _, e in run.recorder.entries[uid]], n)
    figures.update(refused_stale_entries=got.refused, stale_entries_disagreeing=got.stale_disagreeing,
                   overlapping_ranges_dropped=got.overlaps, reply_entries=sum(got.kinds.values()))
    if got.conflicts:
        failures.setdefault("two_tokens_for_one_index", []).append(f"{tag}: {got.conflicts[:4]}")
    if got.errors:
        failures.setdefault("error_replies", []).append(f"{tag}: {got.errors[:1]}")
    if got.finish != ["length"] * n or got.ends != [max_tokens] * n:
        failures.setdefault("reply_stream_incomplete", []).append(
            f"{tag}: ends={got.ends} finish={got.finish} entries={entry_outline(run.recorder.entries[uid])}")
    return got


def entry_outline(entries: list[tuple[str, dict]], most: int = 60) -> str:
    """A reply stream in brief, for a failure's message (CI keeps no logs): each entry's kind, epoch and range
    (`d1:25-30` a delta of epoch 1, `f2` a fence, `e0` an error), the last `most` of them."""
    def one(e: dict) -> str:
        kind, epoch = e.get("kind", "?"), int(e.get("epoch") or 0)
        where = f":{e['start']}-{e['end']}" if kind == "delta" else ""
        choice = f"#{e['index']}" if e.get("index") else ""
        return f"{kind[0]}{epoch}{choice}{where}{'!' if e.get('finish_reason') else ''}"

    return " ".join(one(e) for _, e in entries[-most:])


def resume_figures(run: Run) -> dict:
    """Time to resume: for each stream a disruption hit, the wait between its chunks that spans the disruption
    (the wait for the first chunk when it came before any); seconds, per kind of disruption and over all."""
    by_uid = {o.uid: o for o in run.clients.outcomes if o.uid}
    per_kind: dict[str, list[float]] = {}
    for e in run.chaos.events:
        kind = f"kill:{e.role}" if e.kind == "kill" else e.kind
        gaps = [by_uid[u].gap_at(e.at) for u in e.victims if u in by_uid]
        per_kind.setdefault(kind, []).extend(g for g in gaps if g is not None)
    per_kind["all"] = [g for gaps in list(per_kind.values()) for g in gaps]
    return {kind: {"streams": len(gaps), "p50": _round(percentile(gaps, 50)), "p99": _round(percentile(gaps, 99)),
                   "max": _round(max(gaps, default=None))} for kind, gaps in per_kind.items()}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def test_chaos_run_at_scale(redis_server, demo_model_dir, tmp_path_factory, tmp_path):
    s = new_stack(redis_server, demo_model_dir, tmp_path_factory, "chaos")
    try:
        began = time.monotonic()
        ports = start_replicas(s, {"tokenizer": 2, "scheduler": 3, "detokenizer": 2}, apis=2, **ENV)
        start_s = time.monotonic() - began
        timeout = 300.0 if LONG else 120.0  # the requests' own deadline: a loaded machine must not reach it
        jobs = make_jobs(range(320 if LONG else 80), timeout)
        # wave2: for the tokenizer kill; wave3: work for the last freeze to hit
        wave2, wave3 = ([], []) if LONG else (make_jobs(range(80, 100), timeout), make_jobs(range(100, 104), timeout))
        began = time.monotonic()
        reference = asyncio.run(reference_texts(s.base_url, [j for j in jobs + wave2 + wave3
                                                             if j.kind != "unseeded"]))
        undisturbed_s = time.monotonic() - began
        run = Run(s, ports, tmp_path)
        wall = asyncio.run(run.run(jobs, wave2, wave3))
        began = time.monotonic()
        failures, stream_figures = check_outcomes(run, reference)
        problems = settled_problems(s, timeout=15)
        after_s = time.monotonic() - began
        events = run.chaos.events
        outcomes = run.clients.outcomes
        figures = {
            "mode": "long" if LONG else "ci", "requests": len(outcomes),
            "choices": sum(o.job.n for o in outcomes),
            "completion_tokens": sum(o.job.n * o.job.max_tokens for o in outcomes),
            "wall_s": round(wall, 1), "reference_run_s": round(undisturbed_s, 1), "start_s": round(start_s, 1),
            "checks_s": round(after_s, 1),
            "kills": dict(Counter(e.role for e in events if e.kind == "kill")),
            "stops": sum(e.kind == "stop" for e in events),
            "api_restarts": sum(e.kind == "api_restart" for e in events),
            "victims": {f"{e.kind}:{e.target}@{e.at:.1f}": len(e.victims) for e in events},
            "taken_over_while_frozen": [len(e.taken) for e in events if e.kind == "stop"],
            "restart_s": {e.replacement: e.restart_s for e in events if e.replacement},
            "log_counts": log_counts(s.log_dir), **stream_figures,
            "reattached": sum(o.reattached for o in outcomes), "resubmitted": sum(o.resubmitted for o in outcomes),
            "rerouted": sum(o.rerouted for o in outcomes),
            "streams_past_the_cap": run.trimmed, "time_to_resume_s": resume_figures(run),
            "failures": {k: len(v) for k, v in failures.items()}, "problems_afterwards": problems,
            "failure_examples": {k: v[:5] for k, v in failures.items()}, "recorder_missed": run.missing,
        }
        print(json.dumps(figures, indent=1))
        (tmp_path / "chaos.json").write_text(json.dumps(figures, indent=1))
        (tmp_path / "outcomes.json").write_text(json.dumps(  # what each client saw, next to replies.json
            [{**o.record(), "reference": reference.get(o.job.key)} for o in outcomes]))
        if LONG:
            (ROOT / "bench" / "results" / "chaos.json").write_text(json.dumps(figures, indent=1) + "\n")

        # The harness itself: it saw every entry, the disruptions hit requests (each struck once its target held
        # some) and peers took over from every frozen scheduler (else the run proves nothing). LONG's last
        # disruptions may come after the last request ended.
        assert not run.missing, f"the recorder missed reply entries: {run.missing}"
        assert run.trimmed > 0, "no reply stream went past the cap"
        hit = [bool(e.victims) for e in events] + [bool(e.taken) for e in events if e.kind == "stop"]
        assert (any if LONG else all)(hit), [(e.kind, e.target, len(e.victims), len(e.taken)) for e in events]
        assert not failures and not problems, json.dumps({"failures": {k: v[:5] for k, v in failures.items()},
                                                          "problems": problems}, indent=1)
    finally:
        s.stop()

