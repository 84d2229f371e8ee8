"""`rsinfer inspect` (requests and backlogs, read from Redis), `rsinfer healthcheck` (liveness) and
`rsinfer drain` (an API pod's preStop hook)."""

from __future__ import annotations

import argparse
import asyncio
import json
import textwrap
import time
from urllib.parse import urlsplit, urlunsplit

from redis.exceptions import RedisClusterException, RedisError, ResponseError

from rsinfer.command_settings import DrainCommand, ProbeSettings
from services.api.edge.admin import call as admin_call
from services.api.edge.admin import control_sockets
from shared import streams
from shared.heartbeats import declared_models, live_workers
from shared.keys import STAGES, Keys
from shared.liveness import check, liveness_path
from shared.redis_conn import connect
from shared.request_states import TERMINAL
from shared.request_store import RequestStore
from shared.settings import CommonSettings, RedisSettings

# what the tool reads by, as every process of a deployment does by default (it has no flags for them)
HEARTBEAT_TTL_S = CommonSettings.model_fields["heartbeat_ttl_s"].default
REQUEST_TTL_S = CommonSettings.model_fields["request_ttl_s"].default
REPLY_MAXLEN = CommonSettings.model_fields["reply_maxlen"].default


async def inspect(settings: RedisSettings, args: argparse.Namespace) -> int:
    """One request's record (`uid`), or the overview: workers with their load, stage backlogs, adapters and
    requests; with `--watch` the overview again every so many seconds, until Ctrl-C. A Redis that cannot be
    reached is one line and exit status 1."""
    redis = None
    try:
        redis = connect(settings.redis_url, **settings.redis_options())
        keys = Keys(settings.namespace)
        requests = RequestStore(redis, keys, REQUEST_TTL_S, REPLY_MAXLEN)  # only read here
        if args.uid:
            return await _print_record(requests, args.uid)
        while True:
            text = "\n".join(await overview(redis, keys, requests, HEARTBEAT_TTL_S, args.all))
            print(f"\033[H\033[2J{text}" if args.watch else text, flush=True)  # a watch redraws the screen
            if not args.watch:
                return 0
            await asyncio.sleep(args.watch)
    except (RedisError, RedisClusterException, OSError) as e:
        print(f"rsinfer inspect: cannot reach Redis at {redacted(settings.redis_url)}: {e}")
        return 1
    finally:
        if redis is not None:
            await redis.aclose()


def redacted(url: str) -> str:
    """The URL without a password in it."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{parts.hostname}"
                                            f"{f':{parts.port}' if parts.port else ''}"))


async def _print_record(requests: RequestStore, uid: str) -> int:
    record = await requests.record(uid)
    if not record:
        print(f"no request {uid}")
        return 1
    print(json.dumps(record, indent=2))
    return 0


WIDTH = 120  # every table fits a terminal this wide: long cells are cut (…), a worker's extra figures left out
MOST_REQUESTS = 100  # requests listed, oldest first (the count says how many more are in flight)
# a worker's figures shown first when it reports them; the rest follow as reported, while the table fits
FIRST_COLUMNS = ("running", "waiting", "requests", "inflight", "draining", "held", "kv_used_tokens",
                 "kv_total_tokens", "last_step_at")
SHORT = {"running_sequences": "seqs", "kv_used_tokens": "kv_used", "kv_total_tokens": "kv_total",
         "prefix_hit_tokens": "prefix_hit", "last_step_at": "last_step", "subscriptions": "subs",
         "prefix_page_size": "page", "finished_tracked": "finished", "kv_cache_usage": "kv_usage"}


def cut(text: str, width: int) -> str:
    """`text` in at most `width` characters (its end replaced by … when longer)."""
    return text if len(text) <= width else text[:width - 1] + "…"


async def overview(redis, keys: Keys, requests: RequestStore, heartbeat_ttl_s: float, every: bool = False
                   ) -> list[str]:
    workers = await live_workers(redis, keys, heartbeat_ttl_s)
    lines = worker_tables(workers, time.time())
    lines += rank_lines(workers)
    lines.append(f"{'MODEL':32} {'STAGE':12} {'LAG':>6} {'PENDING':>8}")
    # declared models too: one scaled to zero has requests waiting for its workers
    for model in sorted({w.model for w in workers if w.model} | set(await declared_models(redis, keys))):
        for stage in STAGES:
            try:
                groups = await streams.groups(redis, keys.stage_stream(stage, model))
            except ResponseError:  # no such stream yet
                continue
            for g in groups:
                lines.append(f"{cut(model, 32):32} {stage:12} {g.get('lag') or 0:>6} {g.get('pending', 0):>8}")
    lines += await _adapter_lines(redis, keys, workers)
    lines += await _usage_lines(redis, keys)
    lines += await _batch_lines(redis, keys)
    lines += await request_lines(redis, keys, requests, every)
    return lines


REQUEST_FIELDS = ("status", "kind", "model", "prompt_tokens", "completion_tokens", "created_at")


async def request_lines(redis, keys: Keys, requests: RequestStore, every: bool) -> list[str]:
    """The requests in flight, oldest first, from their index (`Keys.inflight`: no SCAN); `every`: every record
    Redis still keeps, finished ones too, found by SCAN (slow on a large Redis)."""
    if every:
        uids = [keys.uid_of_request_key(k.decode()) async for k in redis.scan_iter(match=keys.request_pattern(),
                                                                                     count=500)]
        count = len(uids)
    else:
        count, uids = await requests.inflight(MOST_REQUESTS)
    rows = [(uid, dict(zip(REQUEST_FIELDS, values, strict=True)))
            for uid, values in (await requests.fields(uids, *REQUEST_FIELDS)).items()]
    # a record gone (expired) or ended: its index entry is on its way out
    rows = [(u, r) for u, r in rows if r["status"] is not None and (every or r["status"] not in TERMINAL)]
    now = time.time()
    rows.sort(key=lambda row: float(row[1]["created_at"] or now))
    what = f"REQUESTS: {count} records" if every else f"IN FLIGHT: {count}"
    if count > len(uids):
        what += f" (the {len(uids)} nearest their deadline shown)"
    # KIND: chat, completion, generate, response, the prefill-only embedding and score, or a /tokenize or
    # /detokenize query (answered by a tokenizer)
    lines = [f"\n{what}", f"{'UID':32} {'STATUS':9} {'KIND':10} {'MODEL':32} {'PROMPT':>7} {'DONE':>7} {'AGE':>8}"]
    for uid, r in rows:
        age = now - float(r["created_at"] or now)
        lines.append(f"{cut(uid, 32):32} {cut(r['status'], 9):9} {cut(r['kind'] or '-', 10):10} "
                     f"{cut(r['model'] or '', 32):32} {r['prompt_tokens'] or '':>7} {r['completion_tokens'] or '':>7} "
                     f"{age:>7.1f}s")
    return lines


def worker_tables(workers: list, now: float) -> list[str]:
    """One table per role: a worker per row, a column per figure of its load (what its heartbeat reports;
    nested objects such as `model_info` are left out, times shown as ages), as many as fit WIDTH; the others are
    named below it."""
    lines: list[str] = []
    for role in sorted({w.role for w in workers}):
        rows = sorted((w for w in workers if w.role == role), key=lambda w: w.id)
        reported = list(dict.fromkeys(k for w in rows for k, v in w.load.items() if not isinstance(v, dict)
                                      and k not in TABLES_OF_THEIR_OWN))
        columns = [c for c in FIRST_COLUMNS if c in reported] + [c for c in reported if c not in FIRST_COLUMNS]
        cells = [[cut(w.id, 36), cut(w.model or "-", 24)] for w in rows]
        header = ["WORKER", "MODEL"]
        left_out = []
        for c in columns:
            column = [cut(_cell(c, w.load.get(c), now), 16) for w in rows]
            widths = [max(len(r[i]) for r in [header, *cells]) for i in range(len(header))]
            if sum(widths) + 2 * len(widths) + max(len(x) for x in [SHORT.get(c, c), *column]) > WIDTH:
                left_out.append(c)
                continue
            header.append(SHORT.get(c, c).upper())
            for row, cell in zip(cells, column, strict=True):
                row.append(cell)
        lines += [role.upper(), *aligned([header, *cells])]
        if left_out:
            lines += textwrap.wrap(f"(also in its heartbeat: {', '.join(left_out)})", WIDTH)
        lines.append("")
    return lines


TABLES_OF_THEIR_OWN = ("tp_ranks",)  # a figure per rank: rank_lines


def rank_lines(workers: list) -> list[str]:
    """The ranks of each tensor-parallel scheduler (services/scheduler/engine/tp_group.py): process, device, the
    weights it holds and its KV cache (each holds its share of the KV heads for every token)."""
    rows = [[w.id, str(r.get("rank")), str(r.get("pid")), str(r.get("device")),
             f"{(r.get('weight_bytes') or 0) / 2**20:.1f}", str(r.get("kv_tokens"))]
            for w in sorted(workers, key=lambda w: w.id) for r in w.load.get("tp_ranks") or []]
    if not rows:
        return []
    return ["TENSOR-PARALLEL RANKS", *aligned([["WORKER", "RANK", "PID", "DEVICE", "WEIGHTS_MIB", "KV_TOKENS"], *rows]),
            ""]


def _cell(name: str, value, now: float) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if name.endswith("_at") and isinstance(value, int | float):
        return f"{max(0.0, now - value):.1f}s ago"
    if isinstance(value, list):
        return ",".join(map(str, value)) or "-"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def aligned(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]


async def _usage_lines(redis, keys: Keys) -> list[str]:
    """Each tenant's usage (services/api/multitenancy/tenancy.py): requests, prompt, cached and generated tokens so
    far."""
    usage: dict[str, dict[str, str]] = {}
    for field, value in (await redis.hgetall(keys.usage())).items():
        tenant, _, counter = field.decode().rpartition(":")
        usage.setdefault(tenant, {})[counter] = value.decode()
    if not usage:
        return []
    counters = ("requests", "prompt_tokens", "cached_tokens", "generated_tokens")
    lines = [f"\n{'TENANT':24} {'REQUESTS':>10} {'PROMPT':>12} {'CACHED':>12} {'GENERATED':>12}"]
    for tenant, row in sorted(usage.items()):
        lines.append(f"{cut(tenant, 24):24} " + " ".join(f"{row.get(c, '0'):>{10 if c == 'requests' else 12}}"
                                                for c in counters))
    return lines


async def _adapter_lines(redis, keys: Keys, workers: list) -> list[str]:
    """The LoRA adapters registered (shared/adapter_registry.py), and which live schedulers hold each loaded."""
    from shared.adapter_registry import registered

    records = await registered(redis, keys)
    if not records:
        return []
    lines = [f"\n{'ADAPTER':24} {'BASE':20} {'RANK':>4} {'RESIDENT ON':32} SOURCE"]
    for name, r in sorted(records.items()):
        on = [w.id for w in workers if w.role == "scheduler" and r.identity in w.load.get("lora_adapters", ())]
        source = r.path or "store:" + r.stored
        lines.append(f"{cut(name, 24):24} {cut(r.base, 20):20} {r.rank:>4} {cut(','.join(on) or '-', 32):32} "
                     f"{cut(source, WIDTH - 84)}")
    return lines


async def _batch_lines(redis, keys: Keys, newest: int = 20) -> list[str]:
    """The newest batches (services/api/batch_api/batches.py) with their status and counts."""
    ids = [i.decode() for i in await redis.zrevrange(keys.batches(), 0, newest - 1)]
    rows = [(i, await redis.hgetall(keys.batch(i))) for i in ids]
    rows = [(i, {k.decode(): v.decode() for k, v in h.items()}) for i, h in rows if h]
    if not rows:
        return []
    lines = [f"\n{'BATCH':38} {'STATUS':11} {'ENDPOINT':22} {'TOTAL':>6} {'DONE':>6} {'FAILED':>6}"]
    for i, h in rows:
        lines.append(f"{i:38} {h.get('status', '?'):11} {cut(h.get('endpoint', ''), 22):22} {h.get('total', '-'):>6} "
                     f"{h.get('completed', '0'):>6} {h.get('failed', '0'):>6}")
    return lines


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


async def heartbeat_fresh(settings: ProbeSettings, role: str) -> tuple[bool, str]:
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


def drain(settings: DrainCommand, wait: float) -> int:
    """Drain the API process of this pod (each of --api-workers') through its control socket
    (services/api/edge/admin.py): it turns unready and refuses new requests for --drain-timeout-s, unless SIGTERM
    comes first; then keep the hook running for `wait` seconds (so Kubernetes holds SIGTERM back while load
    balancers notice). Only a process that can open the socket (one of this pod, as this user) can drain it:
    there is no HTTP route for it."""
    if wait >= settings.drain_timeout_s:
        print(f"drain failed: --wait {wait} must be shorter than --drain-timeout-s {settings.drain_timeout_s}, "
              "after which the API goes back in service")
        return 1
    failed = False
    for path in control_sockets(settings.admin_socket, settings.port):  # each of --api-workers' processes
        try:
            reply = admin_call(path, "drain")
        except (OSError, ValueError) as e:
            print(f"drain failed: {path}: {e}")
            failed = True
            continue
        print(json.dumps(reply))
        failed = failed or "error" in reply
    if failed:
        return 1
    time.sleep(max(0.0, wait))
    return 0
