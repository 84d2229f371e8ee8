"""The clients' command packer (shared/redis_conn.py ArgsPacker): the bytes redis-py would send, for every kind of
argument rsinfer sends, and redis-py's own errors for what it refuses; and that the clients' connections use it."""

from __future__ import annotations

import pytest
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.exceptions import DataError

from shared.redis_conn import ArgsPacker, connect, connect_single, packing_connection_class

pytestmark = pytest.mark.timeout(30)

KEYS = [f"rsinfer:reply:{{{i:032x}}}" for i in range(256)]
COMMANDS = [
    ("XREAD", "BLOCK", 2000, "COUNT", 256, "STREAMS", *KEYS, *(f"17966{i:08d}-{i % 3}" for i in range(256))),
    ("HSET", "rsinfer:req:{u1}", "deadline", 1796633136.703, "n", 1, "logprobs", 0, "created", 1796632536,
     "prompt", "ünïcødé ✓ 日本", "raw", b"\x00\xff\r\n", "empty", "", "neg", -5, "big", 2**70, "tiny", 5e-324),
    ("XADD", "rsinfer:tokenize:m", "MAXLEN", "~", 275882, "*", "data", '{"kind":"tokenize","uid":"u1"}'),
    ("EVAL", "return redis.call('XACK', KEYS[1], ARGV[1])", 1, "s", "g", "1-0"),
    ("ZADD", "rsinfer:inflight", 1796633136.7029827, "u1"),
    ("EXPIRE", "k", 600),
    ("CLIENT SETNAME", "api-1"),  # a name of two words: redis-py splits it
    (b"XINFO GROUPS", b"s"),
    ("SET", "k", bytearray(b"ab")),
    ("SET", "k", memoryview(b"cd")),
    ("SET", "k", float("inf")),
]


def redis_py_packer():
    return Connection()._command_packer


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: str(a[0]))
def test_the_packer_sends_what_redis_py_sends(args):
    ours = ArgsPacker(redis_py_packer()).pack(*args)
    assert b"".join(ours) == b"".join(redis_py_packer().pack(*args))
    assert b"".join(ours) == b"".join(Connection()._pack_command_python(*args))  # redis-py without hiredis


@pytest.mark.parametrize("bad", [True, None, object()])
def test_what_redis_py_refuses_it_refuses_alike(bad):
    with pytest.raises(DataError) as ours:
        ArgsPacker(redis_py_packer()).pack("SET", "k", bad)
    with pytest.raises(DataError) as theirs:
        redis_py_packer().pack("SET", "k", bad)
    assert str(ours.value) == str(theirs.value)


def test_a_string_utf8_cannot_encode_fails_as_with_redis_py():
    with pytest.raises(UnicodeEncodeError):
        ArgsPacker(redis_py_packer()).pack("SET", "k", "a\udcff")  # a lone surrogate, as redis-py refuses it
    with pytest.raises(UnicodeEncodeError):
        redis_py_packer().pack("SET", "k", "a\udcff")


@pytest.mark.parametrize(("url", "base"), [("redis://127.0.0.1:6379/0", Connection),
                                           ("rediss://127.0.0.1:6380", SSLConnection),
                                           ("unix:///tmp/redis.sock", UnixDomainSocketConnection)])
def test_each_kind_of_connection_packs_with_it(url, base):
    cls = packing_connection_class(url)
    assert issubclass(cls, base) and packing_connection_class(url) is cls
    kw = {"path": "/tmp/redis.sock"} if base is UnixDomainSocketConnection else {"host": "127.0.0.1"}
    conn = cls(**kw)  # not connected
    assert isinstance(conn._command_packer, ArgsPacker)
    assert conn.pack_command("SET", "k", 1) == [b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\n1\r\n"]


async def test_the_clients_talk_to_redis_through_it(redis_server):
    pooled, single = connect(redis_server.url), connect_single(redis_server.url)
    try:
        keys = [f"test-redis-conn:{{{i}}}" for i in range(300)]
        async with pooled.pipeline(transaction=True) as pipe:
            for i, key in enumerate(keys):
                pipe.xadd(key, {"data": f"ü{i}", "n": i, "t": 0.25 * i})
            ids = await pipe.execute()
        read = await single.xread(dict.fromkeys(keys, "0-0"))
        assert {k.decode(): v for k, v in read} == {
            key: [(ids[i], {b"data": f"ü{i}".encode(), b"n": str(i).encode(), b"t": repr(0.25 * i).encode()})]
            for i, key in enumerate(keys)}
        conn = await pooled.connection_pool.get_connection()
        try:
            assert isinstance(conn._command_packer, ArgsPacker)
        finally:
            await pooled.connection_pool.release(conn)
        assert isinstance(single.connection._command_packer, ArgsPacker)
    finally:
        await pooled.delete(*keys)
        await pooled.aclose()
        await single.aclose()

