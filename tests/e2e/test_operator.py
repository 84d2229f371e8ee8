"""The operator recipes of docs/design.md ("Operator recipes") work during a long generation: find the
request, read its record and reply stream, see the stage backlogs, and cancel it; the client then sees
finish_reason "abort"."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.support.helpers import wait_for
from tests.support.stack import MODEL

pytestmark = pytest.mark.timeout(90)


class LongStream:
    """A streaming request that would run for thousands of tokens, followed in a thread."""

    def __init__(self, stack):
        self.id: str | None = None
        self.finish: str | None = None
        self.text = ""
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(stack,), daemon=True)
        self.thread.start()
        assert self.started.wait(30)

    @property
    def uid(self) -> str:
        return self.id.removeprefix("chatcmpl-")

    def _run(self, stack):
        stream = stack.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Write forever"}], max_tokens=3500,
            temperature=0, stream=True, extra_body={"ignore_eos": True})
        for chunk in stream:
            self.id = chunk.id
            if chunk.choices:
                self.text += chunk.choices[0].delta.content or ""
                self.finish = chunk.choices[0].finish_reason or self.finish
            if len(self.text) > 20:
                self.started.set()

    def wait(self, timeout: float = 20) -> float:
        t0 = time.monotonic()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream did not end"
        return time.monotonic() - t0


def test_operator_can_find_read_and_cancel_a_request(stack):
    r = stack.redis()
    k = stack.keys
    run = LongStream(stack)
    uid = run.uid
    # redis-cli ZRANGE rsinfer:inflight -inf +inf BYSCORE (the index of requests in flight; no SCAN)
    assert uid in r.zrange(k.inflight(), "-inf", "+inf", byscore=True)
    # redis-cli --scan --pattern 'rsinfer:req:*'
    found = [key for key in r.scan_iter(match=k.request_pattern(), count=1000)]
    assert k.request(uid) in found
    # redis-cli HGETALL rsinfer:req:<uid>
    record = r.hgetall(k.request(uid))
    assert record["status"] == "running" and record["model"] == MODEL
    assert record["pod"] and record["scheduler"] and int(record["prompt_tokens"]) > 0
    # redis-cli XRANGE rsinfer:reply:<uid> - + (entries join the steps a read found: how many there are by now
    # depends on the machine's load, so wait for a few)
    wait_for(lambda: len(r.xrange(k.reply(uid), "-", "+")) > 3, timeout=30)
    assert r.ttl(k.reply(uid)) > 0 and r.ttl(k.request(uid)) > 0
    # redis-cli XINFO GROUPS rsinfer:schedule:<model> / XPENDING rsinfer:schedule:<model> scheduler
    groups = {g["name"]: g for g in r.xinfo_groups(k.schedule(MODEL))}
    assert groups["scheduler"]["pending"] >= 1
    pending = r.xpending(k.schedule(MODEL), "scheduler")
    assert pending["pending"] >= 1 and pending["consumers"]
    # rsinfer inspect shows it too
    out = subprocess.run([sys.executable, "-m", "rsinfer.cli", "inspect", "--redis-url", stack.redis_url,
                          "--namespace", stack.namespace], capture_output=True, text=True, timeout=30)
    assert uid in out.stdout and "running" in out.stdout
    # redis-cli SET rsinfer:abort:<uid> admin EX 300
    r.set(k.abort(uid), "admin", ex=300)
    took = run.wait()
    assert run.finish == "abort"
    assert took < 5
    assert r.hgetall(k.request(uid))["status"] == "aborted"


def inspect_lines(stack, *flags: str) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "rsinfer.cli", "inspect", "--redis-url", stack.redis_url,
                          "--namespace", stack.namespace, *flags], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def scans(r) -> int:
    return int(r.info("commandstats").get("cmdstat_scan", {}).get("calls", 0))


def test_inspect_lists_requests_in_flight_oldest_first_in_120_columns_from_their_index(stack):
    r, k = stack.redis(), stack.keys
    older = LongStream(stack)
    newer = LongStream(stack)
    before = scans(r)
    lines = inspect_lines(stack)
    assert scans(r) == before  # read from the index, not by SCAN of every record
    assert all(len(line) <= 120 for line in lines), max(lines, key=len)
    listed = [line.split()[0] for line in lines if line.split() and line.split()[0] in (older.uid, newer.uid)]
    assert listed == [older.uid, newer.uid]
    for run in (older, newer):
        r.set(k.abort(run.uid), "admin", ex=300)
    for run in (older, newer):
        run.wait()
    # each left the index with the write that ended its record
    wait_for(lambda: not {older.uid, newer.uid} & set(r.zrange(k.inflight(), 0, -1)), timeout=10)
    shown = "\n".join(inspect_lines(stack))
    assert older.uid not in shown and newer.uid not in shown
    assert older.uid in "\n".join(inspect_lines(stack, "--all"))  # every record still kept, finished too


def test_delete_endpoint_aborts_a_request(stack):
    run = LongStream(stack)
    resp = httpx.delete(f"{stack.base_url}/v1/requests/{run.id}")
    assert resp.status_code == 200 and resp.json()["aborted"] is True
    run.wait()
    assert run.finish == "abort"
    record = httpx.get(f"{stack.base_url}/v1/requests/{run.uid}").json()
    assert record["status"] == "aborted" and record["error"] == "aborted: api"


def test_unknown_request_is_404(stack):
    assert httpx.get(f"{stack.base_url}/v1/requests/nope").status_code == 404
    assert httpx.delete(f"{stack.base_url}/v1/requests/nope").json()["error"]["code"] == "request_not_found"
