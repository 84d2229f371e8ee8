"""services/scheduler/registered_adapters.py on a real redis-server: a read's adapter names become their registrations'
identities, the engine's source serves their folders (a path, or the object store's copy), and what leaves the
registry or is registered again is evicted from the engine. The engine is a stand-in that records evictions."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from services.scheduler.registered_adapters import RegisteredAdapters
from shared import adapter_registry as registry
from shared.consumer_group import Delivery
from shared.keys import Keys
from shared.messages import SamplingParams, ScheduleJob
from shared.redis_conn import connect
from shared.settings import SchedulerSettings

pytestmark = pytest.mark.timeout(30)
MODEL = "m"


class Engine:
    """What RegisteredAdapters asks of an engine: evictions, recorded."""

    def __init__(self):
        self.evicted: list[str] = []

    def evict_adapter(self, name: str) -> bool:
        self.evicted.append(name)
        return True


@pytest.fixture
async def env(redis_server, tmp_path):
    redis = connect(redis_server.url)
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    settings = SchedulerSettings(namespace=keys.namespace, storage_url=f"file://{tmp_path}/store",
                                 storage_cache_dir=str(tmp_path / "cache"), max_loras=2)
    source = RegisteredAdapters(settings, MODEL)
    engine = Engine()
    source.attach(redis, keys, engine)
    yield redis, keys, source, engine, tmp_path
    await source.close()
    await redis.aclose()


def delivery(uid: str, adapter: str | None) -> Delivery[ScheduleJob]:
    job = ScheduleJob(uid=uid, model=MODEL, pod="p", created_at=0.0, deadline=1.0, params=SamplingParams(),
                      input_ids=[1], adapter=adapter)
    return Delivery(f"1-{uid}", job)


async def test_names_become_identities_and_unknown_ones_stay_names(env):
    redis, keys, source, _, tmp_path = env
    sql = registry.new_record("sql", MODEL, str(tmp_path / "sql"), "")
    other = registry.new_record("theirs", "other-model", "/x", "")
    for record in (sql, other):
        await registry.register(redis, keys, record, 8)
    batch = [delivery("a", "sql"), delivery("b", None), delivery("c", "nope"), delivery("d", "theirs")]
    out = await source.resolved(batch)
    assert [d.msg.adapter for d in out] == [sql.identity, None, "nope", "theirs"]
    assert [d.entry_id for d in out] == [d.entry_id for d in batch]
    assert source.knows(sql.identity) and not source.knows("sql") and not source.knows("theirs")
    assert source.fetch(sql.identity) == tmp_path / "sql"
    assert await source.resolved([delivery("e", None)]) == [delivery("e", None)]  # no adapter: no round trip


async def test_what_leaves_the_registry_or_comes_back_anew_is_evicted(env):
    redis, keys, source, engine, _ = env
    first = registry.new_record("sql", MODEL, "/a", "")
    await registry.register(redis, keys, first, 8)
    await source.sync()
    assert source.knows(first.identity) and engine.evicted == []
    await registry.unregister(redis, keys, "sql")
    again = registry.new_record("sql", MODEL, "/b", "")
    await registry.register(redis, keys, again, 8)
    (d,) = await source.resolved([delivery("a", "sql")])  # seen at admission before the next sync
    assert d.msg.adapter == again.identity and engine.evicted == [first.identity]
    assert not source.knows(first.identity)
    with pytest.raises(KeyError):
        source.fetch(first.identity)  # a loader still asking for the old one: no longer known
    await registry.unregister(redis, keys, "sql")
    await source.sync()
    assert engine.evicted == [first.identity, again.identity] and source.records == {}


async def test_a_stored_adapter_is_fetched_into_the_cache_from_the_loader_thread(env):
    redis, keys, source, _, tmp_path = env
    folder = tmp_path / "store" / "adapters" / "kv"
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text('{"r": 8}')
    (folder / "adapter_model.safetensors").write_bytes(b"weights")
    record = registry.new_record("kv", MODEL, "", "adapters/kv")
    await registry.register(redis, keys, record, 8)
    (d,) = await source.resolved([delivery("a", "kv")])
    fetched = await asyncio.to_thread(source.fetch, d.msg.adapter)  # the engine's loader thread blocks on it
    assert fetched.parent == tmp_path / "cache" and (fetched / "adapter_model.safetensors").read_bytes() == b"weights"
