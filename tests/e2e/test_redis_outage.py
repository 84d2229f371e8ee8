"""Redis goes away and comes back empty: in-flight requests end with an error (no hang), new ones get
503 with Retry-After within a second, /ready goes false, and every service reconnects, recreates its
consumer group and serves again."""

from __future__ import annotations

import time

import httpx
import pytest

from rsinfer.launcher import serving
from rsinfer.redis_server import RedisServer
from tests.support.helpers import wait_for
from tests.support.stack import MODEL, new_stack, start_pipeline
from tests.support.streaming import Streamer, body, reference

pytestmark = pytest.mark.timeout(150)


@pytest.fixture
def own_redis():
    server = RedisServer().start()
    yield server
    server.stop()


def test_redis_outage_and_recovery(own_redis, demo_model_dir, tmp_path_factory):
    s = new_stack(own_redis, demo_model_dir, tmp_path_factory, "outage")
    try:
        start_pipeline(s)
        b = body(1, 12)
        [expected] = reference(s, [b])
        run = Streamer(s.base_url, body(2, 3500))
        wait_for(lambda: len(run.text) > 5, timeout=30)

        own_redis.proc.kill()  # abrupt: no goodbye to any client
        own_redis.proc.wait()
        t0 = time.monotonic()
        resp = httpx.post(f"{s.base_url}/v1/chat/completions", json=b, timeout=10)
        assert time.monotonic() - t0 < 1.0
        assert resp.status_code == 503 and resp.headers["Retry-After"] == "1"
        assert resp.json()["error"]["code"] == "broker_unavailable"
        wait_for(lambda: httpx.get(f"{s.base_url}/ready").status_code == 503, timeout=3)
        run.join(15)
        assert not run.is_alive(), "the in-flight stream hung"
        assert run.error and run.error["code"] == "broker_unavailable"

        restarted = RedisServer(port=own_redis.port).start()  # same address, empty data
        try:
            # every stage back: /ready is the API and Redis; the workers come back on their own
            wait_for(lambda: httpx.get(f"{s.base_url}/ready").status_code == 200, timeout=30)
            wait_for(lambda: serving(s.base_url, MODEL), timeout=30)
            r = httpx.post(f"{s.base_url}/v1/chat/completions", json=b, timeout=30)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == expected
            groups = {g["name"] for g in s.redis().xinfo_groups(s.keys.schedule(MODEL))}
            assert groups == {"scheduler"}
        finally:
            s.stop()
            restarted.stop()
    finally:
        s.stop()
