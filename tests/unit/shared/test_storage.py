"""The object store (shared/storage.py and its backends): one contract, run on both backends (a local directory,
and S3 against a real S3-compatible server, moto in server mode, started by the session fixture), then what each
backend adds."""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save

from rsinfer.command_settings import UpSettings
from rsinfer.flags import flag_parser, settings_from_args
from shared.local_store import LocalStore
from shared.object_store import TMP_DIR, InvalidKey, MiB, NotFound, ObjectStore, StorageError, TooLarge
from shared.s3_store import S3Options, S3Store
from shared.settings import ApiSettings, SchedulerSettings
from shared.storage import open_store
from shared.storage_url import parse_storage_url
from tests.s3_server import CLIENT_ENV

pytestmark = pytest.mark.timeout(60)

CAP = 12 * MiB
PART = 5 * MiB  # S3's smallest part: an 11 MiB upload is 3 parts


@pytest.fixture(params=["local", "s3"])
async def store(request, tmp_path, monkeypatch):
    if request.param == "local":
        s: ObjectStore = LocalStore(tmp_path / "root", max_bytes=CAP, cache_dir=tmp_path / "cache")
    else:
        s = new_s3_store(request.getfixturevalue("s3_server"), tmp_path, monkeypatch)
    await s.check()
    yield s
    await s.close()


@pytest.fixture
async def s3_store(s3_server, tmp_path, monkeypatch):
    s = new_s3_store(s3_server, tmp_path, monkeypatch)
    await s.check()
    yield s
    await s.close()


def new_s3_store(server, tmp_path: Path, monkeypatch) -> S3Store:
    """A store of its own prefix in the session's bucket."""
    for k, v in CLIENT_ENV.items():  # credentials and region only through the standard AWS variables
        monkeypatch.setenv(k, v)
    return S3Store(server.bucket, f"t{uuid.uuid4().hex[:10]}/", max_bytes=CAP, cache_dir=tmp_path / "cache",
                   s3=S3Options(server.url, part_bytes=PART))


def in_progress(store: ObjectStore) -> list[str]:
    """What an unfinished write left behind: the local root's temp files, S3's open multipart uploads."""
    if isinstance(store, LocalStore):
        tmp = store.root / TMP_DIR
        return sorted(os.listdir(tmp)) if tmp.exists() else []
    uploads = store._client.list_multipart_uploads(Bucket=store.bucket, Prefix=store.prefix).get("Uploads", [])
    return [u["Key"] for u in uploads]


def cache_entries(store: ObjectStore) -> list[str]:
    return sorted(os.listdir(store.cache_dir)) if store.cache_dir.exists() else []


async def chunks(total: int, size: int = 256 * 1024, fill: int = 7):
    sent = 0
    while sent < total:
        n = min(size, total - sent)
        yield bytes([fill]) * n
        sent += n
        await asyncio.sleep(0)


async def keys(store: ObjectStore, prefix: str = "") -> list[str]:
    return [i.key async for i in store.list_objects(prefix)]


def peft_folder() -> dict[str, bytes]:
    """A PEFT-like adapter folder: its config and random rank-8 weights in safetensors."""
    rng = np.random.default_rng(0)
    tensors = {f"base_model.model.layers.{i}.self_attn.{p}.lora_{ab}.weight":
               rng.standard_normal((8, 128) if ab == "A" else (128, 8)).astype(np.float32)
               for i in range(2) for p in ("q_proj", "v_proj") for ab in "AB"}
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
              "base_model_name_or_path": "rsinfer-demo"}
    return {"adapter_config.json": json.dumps(config).encode(), "adapter_model.safetensors": save(tensors)}


async def put_folder(store: ObjectStore, prefix: str, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        await store.put(f"{prefix}/{name}", data)


# --- the contract, on both backends


async def test_round_trip_whole_and_streamed(store):
    assert await store.put("files/a.jsonl", b'{"custom_id": "1"}\n') == 19
    assert await store.get("files/a.jsonl") == b'{"custom_id": "1"}\n'
    assert await store.put_stream("files/big", chunks(3 * MiB + 5)) == 3 * MiB + 5
    reader = await store.get_stream("files/big", chunk_size=MiB)
    assert reader.info.size == 3 * MiB + 5
    got = [c async for c in reader]
    assert len(got) >= 4 and b"".join(got) == b"\x07" * (3 * MiB + 5)
    assert (await store.stat("files/big")).size == 3 * MiB + 5
    assert await store.exists("files/big") and not await store.exists("files/nope")
    await store.put("files/empty", b"")
    assert await store.get("files/empty") == b"" and (await store.stat("files/empty")).size == 0


async def test_overwrite_replaces_and_changes_the_version(store):
    await store.put("k", b"one")
    first = await store.stat("k")
    await store.put("k", b"second")
    assert await store.get("k") == b"second"
    assert (await store.stat("k")).version != first.version


async def test_multipart_sized_upload_round_trips(store):
    data = os.urandom(11 * MiB + 3)
    assert await store.put_stream("big/one", chunks_of(data, 640 * 1024)) == len(data)
    assert await store.get("big/one") == data
    assert in_progress(store) == []


async def chunks_of(data: bytes, size: int):
    for i in range(0, len(data), size):
        yield data[i:i + size]


async def test_streaming_cap_refuses_and_leaves_nothing(store):
    with pytest.raises(TooLarge) as err:
        await store.put_stream("files/huge", chunks(2 * MiB), max_bytes=MiB)
    assert err.value.limit == MiB and err.value.key == "files/huge"
    assert not await store.exists("files/huge") and in_progress(store) == []
    # The store's own cap (CAP), past several uploaded parts on S3: the parts are thrown away too.
    with pytest.raises(TooLarge):
        await store.put_stream("files/huge", chunks(CAP + 1))
    assert not await store.exists("files/huge") and in_progress(store) == []
    assert await keys(store) == []


async def test_refused_upload_keeps_the_previous_object(store):
    await store.put("files/x", b"kept")
    with pytest.raises(TooLarge):
        await store.put_stream("files/x", chunks(CAP + MiB))
    assert await store.get("files/x") == b"kept"
    with pytest.raises(TooLarge):
        await store.put("files/x", b"12345", max_bytes=4)
    assert await store.get("files/x") == b"kept"


async def test_failed_or_cancelled_upload_leaves_nothing(store):
    async def breaks():
        async for c in chunks(7 * MiB):
            yield c
        raise ConnectionResetError("client went away")

    with pytest.raises(ConnectionResetError):
        await store.put_stream("files/broken", breaks())
    assert not await store.exists("files/broken") and in_progress(store) == []

    started = asyncio.Event()

    async def stalls():
        async for c in chunks(6 * MiB):
            yield c
        started.set()
        await asyncio.Event().wait()  # stalls until cancelled
        yield b"never"

    task = asyncio.ensure_future(store.put_stream("files/stalled", stalls()))
    await asyncio.wait_for(started.wait(), 20)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not await store.exists("files/stalled") and in_progress(store) == []


async def test_whole_get_is_capped(store):
    await store.put("files/x", b"0123456789")
    with pytest.raises(TooLarge):
        await store.get("files/x", max_bytes=9)
    assert await store.get("files/x", max_bytes=10) == b"0123456789"


async def test_missing_objects_are_not_found_and_delete_is_idempotent(store):
    for call in (store.get("nope"), store.get_stream("nope"), store.stat("nope")):
        with pytest.raises(NotFound) as err:
            await call
        assert err.value.key == "nope"
    await store.put("files/d", b"x")
    await store.delete("files/d")
    await store.delete("files/d")
    await store.delete("never/was")
    assert not await store.exists("files/d")
    with pytest.raises(NotFound):
        await store.get("files/d")


async def test_list_by_prefix_in_key_order(store):
    for key in ("files/b", "files/a", "files/ab/c", "batches/1/out", "files-x"):
        await store.put(key, key.encode())
    assert await keys(store, "files/") == ["files/a", "files/ab/c", "files/b"]
    assert await keys(store, "files/a") == ["files/a", "files/ab/c"]
    assert await keys(store, "files") == ["files-x", "files/a", "files/ab/c", "files/b"]
    assert await keys(store, "nothing/") == []
    assert len(await keys(store)) == 5
    sizes = {i.key: i.size async for i in store.list_objects("batches/")}
    assert sizes == {"batches/1/out": len(b"batches/1/out")}


BAD_KEYS = ["", "/etc/passwd", "../x", "a/../../x", "a/./b", "a//b", "a/", "a\x00b", "a\\b", "a\nb",
            f"{TMP_DIR}/x", "x" * 256, "a/" * 600]


async def test_keys_that_could_escape_are_refused(store):
    for key in BAD_KEYS:
        for call in (store.put(key, b"x"), store.get(key), store.get_stream(key), store.stat(key),
                     store.delete(key), store.exists(key)):
            with pytest.raises(InvalidKey):
                await call
    assert await keys(store) == []


async def test_bad_prefixes_are_refused(store):
    for prefix in ("../", "/abs", "a/../b", "a\x00"):
        with pytest.raises(InvalidKey):
            await keys(store, prefix)
        with pytest.raises(InvalidKey):
            await store.fetch_folder(prefix)


async def test_fetch_folder_gives_a_loadable_peft_folder_and_reuses_it(store):
    files = peft_folder()
    await put_folder(store, "adapters/sql", files)
    await store.put("adapters/sql-v2/adapter_config.json", b"{}")  # a sibling prefix is not part of it
    path = await store.fetch_folder("adapters/sql")
    assert sorted(p.name for p in path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((path / "adapter_config.json").read_text())["r"] == 8
    weights = load_file(path / "adapter_model.safetensors")
    assert len(weights) == 8 and weights["base_model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (8, 128)
    assert await store.fetch_folder("adapters/sql/") == path  # unchanged: the same directory, no download
    assert cache_entries(store) == [path.name]

    await store.put("adapters/sql/adapter_config.json", json.dumps({"r": 16}).encode())
    newer = await store.fetch_folder("adapters/sql")
    assert newer != path and json.loads((newer / "adapter_config.json").read_text())["r"] == 16
    assert json.loads((path / "adapter_config.json").read_text())["r"] == 8  # a loader's open copy stays
    assert await store.evict_folder("adapters/sql") == 2 and cache_entries(store) == []


async def test_fetch_folder_keeps_subfolders(store):
    await store.put("adapters/nested/adapter_config.json", b"{}")
    await store.put("adapters/nested/extra/tokenizer.json", b"[]")
    path = await store.fetch_folder("adapters/nested")
    assert (path / "extra" / "tokenizer.json").read_bytes() == b"[]"


async def test_concurrent_fetches_of_one_folder_share_one_download(store):
    await put_folder(store, "adapters/hot", peft_folder())
    opened, listed, all_listed = [], [], asyncio.Event()
    real_get, real_listing = store.get_stream, store._folder_listing

    async def listing(*args):
        objects = await real_listing(*args)
        listed.append(1)  # from here a fetch goes on, with no await, to the download it starts or joins
        if len(listed) == 8:
            all_listed.set()
        return objects

    async def counting(key, **kw):
        opened.append(key)
        await asyncio.wait_for(all_listed.wait(), 20)  # keep the download in flight until all have arrived
        return await real_get(key, **kw)

    store._folder_listing, store.get_stream = listing, counting
    paths = await asyncio.gather(*(store.fetch_folder("adapters/hot") for _ in range(8)))
    assert len(set(paths)) == 1 and sorted(opened) == ["adapters/hot/adapter_config.json",
                                                       "adapters/hot/adapter_model.safetensors"]
    assert cache_entries(store) == [paths[0].name] and store._fetching == {}


async def test_two_processes_fetching_one_folder_both_get_it_whole(store, tmp_path):
    """Two stores on one cache directory stand for two schedulers on one machine: both download, the
    first rename wins, the loser drops its copy and uses the winner's."""
    files = peft_folder()
    await put_folder(store, "adapters/two", files)
    if isinstance(store, LocalStore):
        other: ObjectStore = LocalStore(store.root, max_bytes=CAP, cache_dir=store.cache_dir)
    else:
        other = S3Store(store.bucket, store.prefix, max_bytes=CAP, cache_dir=store.cache_dir, s3=store.s3)
    both_started = asyncio.Barrier(2)
    for s in (store, other):
        s.get_stream = racing(s.get_stream, both_started)
    try:
        a, b = await asyncio.gather(store.fetch_folder("adapters/two"), other.fetch_folder("adapters/two"))
    finally:
        await other.close()
    assert a == b and (a / "adapter_model.safetensors").read_bytes() == files["adapter_model.safetensors"]
    assert store.get_stream.opened == other.get_stream.opened == 2  # both downloaded it all
    assert cache_entries(store) == [a.name]  # and the loser's copy is gone


def racing(get_stream, barrier: asyncio.Barrier):
    """get_stream that holds its first call until the other store has started its download too."""
    async def wrapped(key, **kw):
        wrapped.opened += 1
        if wrapped.opened == 1:
            await barrier.wait()
        return await get_stream(key, **kw)

    wrapped.opened = 0
    return wrapped


async def test_fetch_folder_limits_and_errors_leave_no_partial_folder(store):
    await put_folder(store, "adapters/big", {"adapter_config.json": b"{}", "adapter_model.safetensors": b"w" * 5000})
    with pytest.raises(TooLarge) as err:
        await store.fetch_folder("adapters/big", max_bytes=4000)
    assert err.value.limit == 4000
    with pytest.raises(TooLarge) as err:
        await store.fetch_folder("adapters/big", max_files=1)
    assert err.value.what == "files"
    with pytest.raises(NotFound):
        await store.fetch_folder("adapters/none")
    assert cache_entries(store) == []

    real = store.get_stream

    async def fails_on_weights(key, **kw):
        if key.endswith(".safetensors"):
            raise StorageError("connection reset mid-download")
        return await real(key, **kw)

    store.get_stream = fails_on_weights
    with pytest.raises(StorageError):
        await store.fetch_folder("adapters/big")
    assert cache_entries(store) == []  # neither the folder nor its temp copy
    store.get_stream = real
    assert (await store.fetch_folder("adapters/big")).is_dir()


async def test_a_folder_that_grows_past_the_cap_while_downloading_is_refused(store):
    await put_folder(store, "adapters/grows", {"a": b"x" * 100, "b": b"y" * 100})
    real = store.get_stream

    async def grows(key, **kw):
        if key.endswith("/b"):
            await store.put(key, b"y" * 1000)  # rewritten between the listing and the download
        return await real(key, **kw)

    store.get_stream = grows
    with pytest.raises(TooLarge):
        await store.fetch_folder("adapters/grows", max_bytes=500)
    assert cache_entries(store) == []


# --- the local backend


async def test_local_symlink_out_of_the_root_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"s")
    store = LocalStore(tmp_path / "root", max_bytes=CAP, cache_dir=tmp_path / "cache")
    await store.check()
    (store.root / "link").symlink_to(outside)
    for call in (store.get("link/secret"), store.put("link/new", b"x"), store.delete("link/secret")):
        with pytest.raises(InvalidKey):
            await call
    assert sorted(os.listdir(outside)) == ["secret"]
    assert await keys(store) == []  # the walk does not follow it either


async def test_local_upload_is_invisible_until_complete(tmp_path):
    store = LocalStore(tmp_path / "root", max_bytes=CAP, cache_dir=tmp_path / "cache")
    await store.put("files/x", b"old")
    halfway = asyncio.Event()
    go_on = asyncio.Event()

    async def slow():
        yield b"n" * (2 * MiB)
        halfway.set()
        await go_on.wait()
        yield b"n"

    task = asyncio.ensure_future(store.put_stream("files/x", slow()))
    await halfway.wait()  # the first chunk is written to the temp file: the next is asked for only then
    assert await store.get("files/x") == b"old" and await keys(store) == ["files/x"]
    assert len(in_progress(store)) == 1
    go_on.set()
    assert await task == 2 * MiB + 1
    assert (await store.stat("files/x")).size == 2 * MiB + 1 and in_progress(store) == []


async def test_local_delete_prunes_empty_directories_and_keys_clash(tmp_path):
    store = LocalStore(tmp_path / "root", max_bytes=CAP, cache_dir=tmp_path / "cache")
    await store.put("batches/b1/output.jsonl", b"{}")
    await store.put("batches/b2/output.jsonl", b"{}")
    await store.delete("batches/b1/output.jsonl")
    await store.delete("batches")  # a directory is no object: nothing to delete
    assert sorted(os.listdir(store.root / "batches")) == ["b2"]
    await store.delete("batches/b2/output.jsonl")
    assert not (store.root / "batches").exists()
    await store.put("a", b"file")
    with pytest.raises(InvalidKey):  # S3 allows both; a directory cannot be a file too
        await store.put("a/b", b"x")
    assert await store.get("a") == b"file" and in_progress(store) == []


async def test_local_check_sweeps_what_a_dead_process_left(tmp_path):
    store = LocalStore(tmp_path / "root", max_bytes=CAP, cache_dir=tmp_path / "cache")
    await store.check()
    stale, fresh = store.root / TMP_DIR / "dead.part", store.root / TMP_DIR / "live.part"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"x")
    os.utime(stale, (0, 0))
    await store.check()
    assert not stale.exists() and fresh.exists()


async def test_local_check_fails_on_an_unwritable_root(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(StorageError):
        await LocalStore(tmp_path / "file" / "root", max_bytes=CAP, cache_dir=tmp_path / "c").check()


# --- the S3 backend


async def test_s3_large_objects_go_up_in_parts(s3_store):
    data = os.urandom(11 * MiB)
    await s3_store.put_stream("files/parts", chunks_of(data, MiB))
    head = s3_store._client.head_object(Bucket=s3_store.bucket, Key=s3_store.prefix + "files/parts")
    assert head["ETag"].strip('"').endswith("-3")  # a multipart ETag: 5 + 5 + 1 MiB
    await s3_store.put("files/whole", data[:MiB])
    whole = s3_store._client.head_object(Bucket=s3_store.bucket, Key=s3_store.prefix + "files/whole")
    assert "-" not in whole["ETag"]


async def test_s3_keys_live_under_the_prefix(s3_store, s3_server):
    raw = s3_server.client()
    raw.put_object(Bucket=s3_store.bucket, Key=s3_store.prefix.rstrip("/") + "-sibling/x", Body=b"not ours")
    raw.put_object(Bucket=s3_store.bucket, Key=s3_store.prefix + "adapters/m/", Body=b"")  # a "folder" marker
    await s3_store.put("files/x", b"ours")
    assert raw.get_object(Bucket=s3_store.bucket, Key=s3_store.prefix + "files/x")["Body"].read() == b"ours"
    assert await keys(s3_store) == ["files/x"]


async def test_s3_folder_with_an_escaping_key_is_refused(s3_store, s3_server, tmp_path):
    raw = s3_server.client()
    raw.put_object(Bucket=s3_store.bucket, Key=s3_store.prefix + "adapters/evil/adapter_config.json", Body=b"{}")
    # A legal S3 key, and a path out of the cache directory if it were joined as it is:
    raw.put_object(Bucket=s3_store.bucket, Key=s3_store.prefix + "adapters/evil/../../../escaped", Body=b"x")
    with pytest.raises(InvalidKey):
        await s3_store.fetch_folder("adapters/evil")
    assert cache_entries(s3_store) == [] and not any(p.name == "escaped" for p in tmp_path.rglob("*"))


async def test_s3_many_objects_list_across_pages(s3_store):
    s3_store.list_page = 7  # S3's pages are of 1000 keys; the continuation is the same with 7
    for i in range(20):
        await s3_store.put(f"many/{i:03d}", b"")
    assert await keys(s3_store, "many/") == [f"many/{i:03d}" for i in range(20)]


async def test_s3_missing_bucket_fails_the_check(s3_server, tmp_path, monkeypatch):
    for k, v in CLIENT_ENV.items():
        monkeypatch.setenv(k, v)
    store = S3Store("no-such-bucket-here", max_bytes=CAP, cache_dir=tmp_path, s3=S3Options(s3_server.url))
    with pytest.raises(StorageError, match="does not exist"):
        await store.check()
    with pytest.raises(StorageError):
        await store.put("x", b"x")
    await store.close()


async def test_s3_from_settings_and_the_standard_aws_environment(s3_server, tmp_path, monkeypatch):
    """Nothing but the URL in rsinfer's settings: endpoint, region and credentials from AWS_* variables."""
    for k, v in CLIENT_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.url)
    bucket = s3_server.bucket
    store = open_store(ApiSettings(storage_url=f"s3://{bucket}/team/rsinfer", storage_cache_dir=str(tmp_path)))
    assert isinstance(store, S3Store) and store.max_bytes == 512 * MiB
    await store.check()
    await store.put("files/f", b"via env")
    assert s3_server.client().get_object(Bucket=bucket, Key="team/rsinfer/files/f")["Body"].read() == b"via env"
    await store.close()


# --- choosing a backend


def test_storage_urls_parse():
    assert parse_storage_url("s3://my-bucket/a/b/").bucket == "my-bucket"
    assert parse_storage_url("s3://my-bucket/a/b/").path == "a/b"
    assert parse_storage_url("s3://my-bucket").path == ""
    assert parse_storage_url("file:///srv/rsinfer").path == "/srv/rsinfer"
    assert parse_storage_url("file:///srv/with%20space").path == "/srv/with space"
    assert parse_storage_url("/srv/plain").path == "/srv/plain"
    for bad in ("http://x/y", "s3://", "s3://B_ad/x", "s3://bucket/../x", "file://host/x", "gs://b"):
        with pytest.raises(ValueError):
            parse_storage_url(bad)


def test_default_store_is_a_directory_under_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("RSINFER_CACHE", str(tmp_path))
    store = open_store(UpSettings())
    assert isinstance(store, LocalStore) and store.root == tmp_path / "storage"
    assert store.cache_dir == tmp_path / "storage-cache"
    monkeypatch.delenv("RSINFER_CACHE")
    assert open_store(SchedulerSettings()).root == Path.home() / ".cache" / "rsinfer" / "storage"


def test_storage_settings_are_flags_and_environment(monkeypatch, tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    flag_parser(ApiSettings, parser)
    args = parser.parse_args(["--storage-url", f"file://{tmp_path}/files", "--max-file-bytes", "1000"])
    settings = settings_from_args(ApiSettings, args)
    store = open_store(settings)
    assert isinstance(store, LocalStore) and store.root == tmp_path / "files" and store.max_bytes == 1000
    monkeypatch.setenv("RSINFER_STORAGE_URL", "s3://from-env/p")
    monkeypatch.setenv("RSINFER_STORAGE_ENDPOINT_URL", "http://127.0.0.1:9")
    assert SchedulerSettings().storage_url == "s3://from-env/p"
    with pytest.raises(ValueError):
        ApiSettings(storage_url="ftp://nope")
    with pytest.raises(ValueError):
        ApiSettings(storage_part_bytes=MiB)  # under S3's smallest part
