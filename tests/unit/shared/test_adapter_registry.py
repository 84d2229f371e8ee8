"""shared/adapter_registry.py: the LoRA adapter registry on a real redis-server (bounded, one version per registration,
equal configurations kept), and what names, paths and --lora-modules entries it takes."""

from __future__ import annotations

import asyncio

import pytest

from shared import adapter_registry as registry
from shared.adapter_registry import Module, RegistryFull, locate, name_problem, parse_lora_modules
from shared.settings import ApiSettings

pytestmark = pytest.mark.timeout(30)


def test_lora_modules_take_name_path_pairs_and_vllm_json():
    text = 'sql=/a/sql  {"name": "chat", "path": "/with space/chat", "base_model_name": "m"}\nkv=s3://b/x'
    assert parse_lora_modules(text) == [Module("sql", "/a/sql"), Module("chat", "/with space/chat", "m"),
                                        Module("kv", "s3://b/x")]
    assert parse_lora_modules("") == []
    for bad in ("sql", "=/a", "sql=", '{"name": "x"}', "{nope"):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules(bad)


def test_names_are_bounded_and_plain():
    assert name_problem("org/sql-v1.2:a+b", 32) is None
    assert "at most 4" in name_problem("abcde", 4)
    for bad in ("", " x", "a b", "-x", "x\n", "é"):
        assert name_problem(bad, 32), bad
    assert name_problem(None, 32)


def test_paths_are_absolute_folders_or_urls_inside_the_store(tmp_path):
    store = f"file://{tmp_path}/store"
    roots = f"/models {tmp_path}/elsewhere"
    assert locate("/models/sql", store, 100, roots) == ("/models/sql", "")
    assert locate(f"file://{tmp_path}/store/adapters/sql", store, 100) == ("", "adapters/sql")
    assert locate(f"file://{tmp_path}/elsewhere/sql", store, 100, roots) == (f"{tmp_path}/elsewhere/sql", "")
    assert locate("s3://bucket/root/adapters/sql/", "s3://bucket/root", 100) == ("", "adapters/sql")
    for bad, says in (("rel/sql", "absolute"), ("", "non-empty"), ("/" + "x" * 100, "at most 100"),
                      ("s3://other/root/sql", "not in the object store"), ("s3://bucket/rootless", "not in"),
                      ("/a\0b", "NUL")):
        with pytest.raises(ValueError, match=says):
            locate(bad, "s3://bucket/root", 100)


async def test_registrations_are_bounded_and_versioned(env):
    redis, keys = env
    one = registry.new_record("sql", "m", "/a", "")
    written, now = await registry.register(redis, keys, one, max_adapters=2)
    assert written and now == one and now.identity == f"sql@{one.version}"
    again = registry.new_record("sql", "m", "/b", "")
    written, now = await registry.register(redis, keys, again, max_adapters=2)
    assert not written and now == one  # a name taken: kept
    await registry.register(redis, keys, registry.new_record("chat", "m", "", "adapters/chat"), max_adapters=2)
    with pytest.raises(RegistryFull, match="--max-adapters"):
        await registry.register(redis, keys, registry.new_record("kv", "m", "/k", ""), max_adapters=2)
    assert sorted(await registry.registered(redis, keys)) == ["chat", "sql"]
    assert (await registry.unregister(redis, keys, "sql")) == one
    assert await registry.unregister(redis, keys, "sql") is None
    assert list(await registry.lookup(redis, keys, ["sql", "chat", "kv"])) == ["chat"]


async def test_configured_registrations_keep_what_is_equal_and_replace_the_rest(env):
    redis, keys = env
    first = registry.new_record("sql", "m", "/a", "")
    await registry.register(redis, keys, first, 4, mode="config")
    written, now = await registry.register(redis, keys, registry.new_record("sql", "m", "/a", ""), 4, mode="config")
    assert not written and now.version == first.version  # the same folder: the same registration
    moved = registry.new_record("sql", "m", "/b", "")
    written, now = await registry.register(redis, keys, moved, 4, mode="config")
    assert written and now == moved and now.identity != first.identity


async def test_concurrent_loads_never_pass_the_bound(env):
    redis, keys = env
    results = await asyncio.gather(*(registry.register(redis, keys, registry.new_record(f"a{k}", "m", "/x", ""), 5)
                                     for k in range(12)), return_exceptions=True)
    assert sum(isinstance(r, RegistryFull) for r in results) == 7
    assert len(await registry.registered(redis, keys)) == 5


async def test_a_field_that_is_no_record_is_no_adapter(env):
    redis, keys = env
    await redis.hset(keys.adapters(), "hand", "not json")
    assert await registry.registered(redis, keys) == {}
    assert await registry.lookup(redis, keys, ["hand"]) == {}


def test_an_identity_gives_back_its_name():
    assert registry.adapter_name("org/sql@1a2b3c4d") == "org/sql" and registry.adapter_name("plain") == "plain"


def test_a_bad_lora_modules_setting_stops_the_process_at_start():
    from pydantic import ValidationError

    from shared.settings import ApiSettings, SchedulerSettings

    assert SchedulerSettings(lora_modules="sql=/a").lora_modules == "sql=/a"
    for cls in (ApiSettings, SchedulerSettings):
        with pytest.raises(ValidationError, match="is not name=path"):
            cls(lora_modules="sql")


def test_a_local_folder_must_lie_inside_lora_roots_whatever_it_is(tmp_path):
    """Outside the roots (or through `..` or a symlink out of them) a path is refused with one message, whether
    it exists or not; no roots: no local folder at all."""
    root, outside = tmp_path / "adapters", tmp_path / "secret"
    (root / "sql").mkdir(parents=True)
    outside.mkdir()
    (root / "link").symlink_to(outside)
    store = f"file://{tmp_path}/store"
    assert locate(f"{root}/sql", store, 1000, f"/nowhere {root}") == (f"{root}/sql", "")
    assert locate(f"{root}/not-yet", store, 1000, str(root)) == (f"{root}/not-yet", "")  # its check says missing
    said = set()
    for bad in ("/etc", "/etc/passwd", "/no/such/dir", str(outside), f"{root}/../secret", f"{root}/link",
                f"{root}x", f"file://{outside}"):
        with pytest.raises(ValueError) as e:
            locate(bad, store, 1000, str(root))
        said.add(str(e.value))
    assert said == {f"lora_path must lie inside --lora-roots ({root})"}
    with pytest.raises(ValueError, match="give --lora-roots"):
        locate(f"{root}/sql", store, 1000, "")
    # --lora-modules: the operator's own paths, wherever they are
    assert locate(f"{root}/link", store, 1000, "", configured=True) == (str(outside), "")
    with pytest.raises(ValueError, match="--lora-roots: 'rel' is not an absolute path"):
        ApiSettings(redis_url="redis://127.0.0.1:1/0", lora_roots="/a rel")
