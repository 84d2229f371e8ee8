"""`rsinfer inspect` (requests and backlogs, read from Redis), `rsinfer healthcheck` (liveness) and
`rsinfer drain` (an API pod's preStop hook)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from services.api.admin import admin_socket_path
from services.api.admin import call as admin_call
from shared import streams
from shared.keys import STAGES, Keys
from shared.liveness import check, liveness_path
from shared.redis_conn import connect
from shared.registry import declared_models, live_workers
from shared.request_store import RequestStore
from shared.settings import ApiSettings, CommonSettings, ProbeSettings


async def inspect(settings: CommonSettings, args: argparse.Namespace) -> int:
    keys = Keys(settings.namespace)
    redis = connect(settings.redis_url, **settings.redis_options())
    requests = RequestStore(redis, keys, settings.request_ttl_s, settings.reply_maxlen)
    try:
        if args.uid:
            record = await requests.record(args.uid)
            if not record:
                print(f"no request {args.uid}")
                return 1
            print(json.dumps(record, indent=2))
            return 0
        workers = await live_workers(redis, keys, settings.heartbeat_ttl_s)
        print(f"{'ROLE':12} {'WORKER':32} {'MODEL':20} LOAD")
        for w in sorted(workers, key=lambda w: (w.role, w.id)):
            print(f"{w.role:12} {w.id:32} {w.model:20} {json.dumps(w.load)}")
        print(f"\n{'MODEL':20} {'STAGE':12} {'LAG':>6} {'PENDING':>8}")
        # declared models too: one scaled to zero has requests waiting for its workers
        for model in sorted({w.model for w in workers if w.model} | set(await declared_models(redis, keys))):
            for stage in STAGES:
                try:
                    groups = await streams.groups(redis, keys.stage_stream(stage, model))
                except Exception:
                    continue
                for g in groups:
                    print(f"{model:20} {stage:12} {g.get('lag') or 0:>6} {g.get('pending', 0):>8}")
        await _print_adapters(redis, keys, workers)
        await _print_batches(redis, keys)
        print(f"\n{'UID':34} {'KIND':10} {'STATUS':10} {'MODEL':20} {'PROMPT':>6} {'DONE':>6} AGE")
        now = time.time()
        async for key in redis.scan_iter(match=keys.request_pattern(), count=500):
            r = await requests.record(keys.uid_of_request_key(key.decode()))
            age = now - float(r.get("created_at", now))
            print(f"{keys.uid_of_request_key(key.decode()):34} {r.get('kind', ''):10} {r.get('status', '?'):10} "
                  f"{r.get('model', ''):20} "
                  f"{r.get('prompt_tokens', ''):>6} {r.get('completion_tokens', ''):>6} {age:.1f}s")
        return 0
    finally:
        await redis.aclose()


async def _print_adapters(redis, keys: Keys, workers: list) -> None:
    """The LoRA adapters registered (shared/adapters.py), and which live schedulers hold each loaded."""
    from shared.adapters import registered

    records = await registered(redis, keys)
    if not records:
        return
    print(f"\n{'ADAPTER':24} {'BASE':20} {'RANK':>4} {'RESIDENT ON':32} SOURCE")
    for name, r in sorted(records.items()):
        on = [w.id for w in workers if w.role == "scheduler" and r.identity in w.load.get("lora_adapters", ())]
        print(f"{name:24} {r.base:20} {r.rank:>4} {','.join(on) or '-':32} {r.path or 'store:' + r.stored}")


async def _print_batches(redis, keys: Keys, newest: int = 20) -> None:
    """The newest batches (services/api/batches.py) with their status and counts."""
    ids = [i.decode() for i in await redis.zrevrange(keys.batches(), 0, newest - 1)]
    rows = [(i, await redis.hgetall(keys.batch(i))) for i in ids]
    rows = [(i, {k.decode(): v.decode() for k, v in h.items()}) for i, h in rows if h]
    if not rows:
        return
    print(f"\n{'BATCH':34} {'STATUS':11} {'ENDPOINT':22} {'TOTAL':>6} {'DONE':>6} {'FAILED':>6}")
    for i, h in rows:
        print(f"{i:34} {h.get('status', '?'):11} {h.get('endpoint', ''):22} {h.get('total', '-'):>6} "
              f"{h.get('completed', '0'):>6} {h.get('failed', '0'):>6}")


def healthcheck(settings: ProbeSettings, args: argparse.Namespace) -> int:
    """Liveness (the default): 0 while this worker's liveness file says its loop moved within max_stall_s and its
    process lives; Redis is not asked, so an outage never fails it (shared/liveness.py). With `--ready`
    (readiness): also its heartbeat in Redis is fresh, so a worker that cannot reach Redis is unready, not dead."""
    path = liveness_path(settings.liveness_file, settings.namespace, args.role, settings.name())
    alive, why = check(path, args.max_stall_s)
    if not alive:
        print(f"unhealthy: {why}")
        return 1
    if args.ready:
        ready, why = asyncio.run(heartbeat_fresh(settings, args.role))
        if not ready:
            print(f"not ready: {why}")
            return 1
    print(f"ok: {why}")
    return 0


async def heartbeat_fresh(settings: CommonSettings, role: str) -> tuple[bool, str]:
    """Redis answers and holds a fresh heartbeat of this worker. The probe runs as another process, so it finds
    the worker by name: the newest heartbeat of `<role>:<name>@...`."""
    keys = Keys(settings.namespace)
    redis = connect(settings.redis_url, **settings.redis_options())
    prefix = f"{role}:{settings.name()}@"
    try:
        members = await redis.zrevrangebyscore(keys.workers(), "+inf", "-inf")
        mine = next((m.decode() for m in members if m.decode().startswith(prefix)), None)
        raw = await redis.hgetall(keys.worker(role, mine.split(":", 1)[1])) if mine else {}
    except Exception as e:
        return False, f"redis: {e}"
    finally:
        await redis.aclose()
    if not raw:
        return False, f"no heartbeat for {prefix}*"
    fields = {k.decode(): v.decode() for k, v in raw.items()}
    if time.time() - float(fields.get("updated_at", 0)) > settings.heartbeat_ttl_s:
        return False, "heartbeat is stale"
    return True, "heartbeat fresh"


def drain(settings: ApiSettings, wait: float) -> int:
    """Drain the API process of this pod through its control socket (services/api/admin.py): it turns unready
    and refuses new requests for --drain-timeout-s, unless SIGTERM comes first; then keep the hook running for
    `wait` seconds (so Kubernetes holds SIGTERM back while load balancers notice). Only a process that can open
    the socket (one of this pod, as this user) can drain it: there is no HTTP route for it."""
    if wait >= settings.drain_timeout_s:
        print(f"drain failed: --wait {wait} must be shorter than --drain-timeout-s {settings.drain_timeout_s}, "
              "after which the API goes back in service")
        return 1
    path = admin_socket_path(settings.admin_socket, settings.port)
    try:
        reply = admin_call(path, "drain")
    except (OSError, ValueError) as e:
        print(f"drain failed: {path}: {e}")
        return 1
    print(json.dumps(reply))
    if "error" in reply:
        return 1
    time.sleep(max(0.0, wait))
    return 0
