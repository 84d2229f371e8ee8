"""Files and Batches keep tenants contained (issue 30, items 3, 4, 11, 16), through the official `openai` SDK on a
stack of separate processes: two API processes reading one keys file, the synthetic engine (20 ms steps), files in a
local directory both API processes share; each API process runs one batch at a time (--batch-max-running 1).

- a suspended tenant's uploads and batch creations are refused (nothing stored), a rate-limited tenant's count;
- a rate-limited tenant's batches park (they hold no runner): another tenant's 1-line batch completes meanwhile,
  and the parked batch completes once its window resets; a batch left `finalizing` can be cancelled;
- a tenant's files and stored bytes are bounded (a 403 naming the setting), released by a delete;
- an output past --max-file-bytes ends its batch `failed` with the reason, leaving nothing stored;
- a tenant's policy is read again for each line; its batch list and file list show only its own;
- the work streams keep only what is still to do; line results of ended batches are swept;
- a runner that takes over a batch does not count again the tokens its predecessor counted.
"""

from __future__ import annotations

import io
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from services.api.batch_api.batch_lines import line_uid
from tests.support.helpers import wait_for
from tests.support.stack import LIFECYCLE_ENV, MODEL, Stack, new_stack, start_replicas

pytestmark = pytest.mark.timeout(300)

TENANTS = ("good", "slow", "off", "cap", "big", "pol", "a2", "b2", "tok")
KEYS = {name: f"sk-{name}-{'0123456789' * 4}" for name in TENANTS}
ADMIN_KEY = f"sk-ops-admin-{'0123456789' * 4}"
SLOW_RPM = 3
MAX_FILE_BYTES = 40_000
MAX_FILES = 6
MAX_TENANT_BYTES = 60_000


def entries(**policies: dict) -> list[dict]:
    base = {name: {"tenant": name, "background": True, "models": [MODEL]} for name in KEYS}
    base["slow"]["requests_per_minute"] = SLOW_RPM
    for name, policy in policies.items():
        base[name] = {**base[name], **policy}
    return [*({"key": KEYS[n], **p} for n, p in base.items()), {"key": ADMIN_KEY, "tenant": "ops", "admin": True}]


def write_keys(path: Path, data: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


class Env:
    def __init__(self, stack: Stack, bases: list[str], keys_file: Path, store: Path):
        self.stack, self.bases, self.keys_file, self.store = stack, bases, keys_file, store

    def client(self, tenant: str, k: int = 0) -> openai.OpenAI:
        key = ADMIN_KEY if tenant == "ops" else KEYS[tenant]
        return openai.OpenAI(base_url=f"{self.bases[k]}/v1", api_key=key, max_retries=0, timeout=60)

    def logs(self) -> str:
        return "".join((self.stack.log_dir / f"api{k}.log").read_text(errors="replace") for k in (1, 2))


@pytest.fixture(scope="module")
def env(redis_server, demo_model_dir, tmp_path_factory) -> Iterator[Env]:
    s = new_stack(redis_server, demo_model_dir, tmp_path_factory, "batchten")
    keys_file = s.log_dir / "api-keys.json"
    store = s.log_dir / "store"
    write_keys(keys_file, entries())
    try:
        ports = start_replicas(
            s, {}, 2, api_key=ADMIN_KEY, **{**LIFECYCLE_ENV, "PYTHONUNBUFFERED": "1"},
            RSINFER_API_KEYS_FILE=str(keys_file), RSINFER_API_KEYS_CHECK_S="0.2", RSINFER_ENGINE="synthetic",
            RSINFER_STEP_MS="20", RSINFER_STORAGE_URL=f"file://{store}", RSINFER_BATCH_CLAIM_IDLE_S="3",
            RSINFER_BATCH_MAX_RUNNING="1", RSINFER_MAX_FILE_BYTES=str(MAX_FILE_BYTES),
            RSINFER_MAX_FILES_PER_TENANT=str(MAX_FILES), RSINFER_MAX_FILE_BYTES_PER_TENANT=str(MAX_TENANT_BYTES),
            RSINFER_USAGE_FLUSH_S="0.2", RSINFER_BATCH_SWEEP_S="1")
        yield Env(s, [f"http://127.0.0.1:{p}" for p in ports], keys_file, store)
    finally:
        s.stop()


def line(k: int, max_tokens: int = 3, url: str = "/v1/chat/completions") -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"line {k}"}], "max_tokens": max_tokens,
            "ignore_eos": True}
    return {"custom_id": f"c{k}", "method": "POST", "url": url, "body": body}


def upload(c: openai.OpenAI, rows: list[dict]) -> str:
    data = "\n".join(json.dumps(r) for r in rows).encode()
    return c.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id


def create(c: openai.OpenAI, file_id: str, **extra):
    return c.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                            **extra)


def wait_end(c: openai.OpenAI, batch_id: str, timeout: float = 60):
    wait_for(lambda: c.batches.retrieve(batch_id).status in ("completed", "failed", "cancelled", "expired"),
             timeout=timeout, every=0.2)
    return c.batches.retrieve(batch_id)


def auth(tenant: str) -> dict:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def test_a_suspended_tenants_uploads_and_batch_creations_are_refused_and_store_nothing(env):
    off = env.client("off")
    file_id = upload(off, [line(0)])  # before it is suspended
    write_keys(env.keys_file, entries(off={"max_concurrent": 0}))
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    for base in env.bases:  # once each process has read the keys file again
        wait_for(lambda base=base: httpx.post(f"{base}/v1/chat/completions", headers=auth("off"), timeout=10,
                                              json=line(0)["body"]).status_code == 429, timeout=10, every=0.2)
    codes = set()
    with httpx.Client(timeout=10, headers=auth("off")) as http:
        for k in range(300):
            base = env.bases[k % 2]
            made = http.post(f"{base}/v1/batches", json=body)
            sent = http.post(f"{base}/v1/files", files={"file": ("x.jsonl", b"{}")}, data={"purpose": "batch"})
            codes |= {(resp.status_code, (resp.json().get("error") or {}).get("code")) for resp in (made, sent)}
    assert codes == {(403, "tenant_suspended")}
    r = env.stack.redis()
    assert r.zcard(env.stack.keys.tenant_batches("off")) == 0 and not r.exists(env.stack.keys.batch_work("off"))
    assert r.zcard(env.stack.keys.tenant_files("off")) == 1
    write_keys(env.keys_file, entries())


@pytest.fixture(scope="module")
def slow(env) -> tuple[list[str], int]:
    """Two batches of a tenant whose requests per minute its upload and the two creations use up: parked; and
    the status of the upload it tried next."""
    wait_for(lambda: time.time() % 60 < 40, timeout=25, every=0.2)  # the three fit in one minute's window
    c1, c2 = env.client("slow"), env.client("slow", 1)
    file_id = upload(c1, [line(0), line(1)])
    ids = [create(c1, file_id).id, create(c2, file_id).id]
    resp = httpx.post(f"{env.bases[1]}/v1/files", headers=auth("slow"), files={"file": ("x.jsonl", b"{}")},
                      data={"purpose": "batch"}, timeout=10)
    return ids, resp.status_code


def test_uploads_and_batch_creations_count_in_the_requests_per_minute(slow):
    assert slow[1] == 429


def test_a_rate_limited_tenants_batches_park_while_another_tenants_batch_completes(env, slow):
    slow, c = slow[0], env.client("slow")
    wait_for(lambda: all(c.batches.retrieve(i).status == "in_progress" for i in slow), timeout=30, every=0.2)
    good = env.client("good", 1)
    batch = create(good, upload(good, [line(0)]))
    done = wait_end(good, batch.id, timeout=30)
    assert done.status == "completed" and done.request_counts.completed == 1
    wait_for(lambda: all(f"batch={i} parked" in env.logs() for i in slow), timeout=10, every=0.2)


def test_a_batch_left_finalizing_can_be_cancelled(env, slow):
    """As a runner that dies while it writes the files leaves it; the next run ends it cancelled."""
    slow, c = slow[0], env.client("slow", 1)
    env.stack.redis().hset(env.stack.keys.batch(slow[0]), "status", "finalizing")
    assert c.batches.cancel(slow[0]).status == "cancelling"
    done = wait_end(c, slow[0], timeout=30)
    assert done.status == "cancelled" and done.cancelled_at


def test_a_tenants_files_and_bytes_are_bounded_across_processes(env):
    clients = [env.client("cap"), env.client("cap", 1)]
    small = [upload(clients[k % 2], [line(k)]) for k in range(MAX_FILES)]
    with pytest.raises(openai.PermissionDeniedError) as e:
        upload(clients[1], [line(9)])
    assert "--max-files-per-tenant" in e.value.message
    for file_id in small[1:]:
        clients[0].files.delete(file_id)
    pad = {"custom_id": "p", "method": "POST", "url": "/v1/chat/completions", "body": {"x": "y" * 25_000}}
    upload(clients[0], [pad])
    upload(clients[1], [pad])
    with pytest.raises(openai.PermissionDeniedError) as e:
        upload(clients[0], [pad])
    assert "--max-file-bytes-per-tenant" in e.value.message
    assert len(clients[1].files.list().data) == 3


def test_an_output_past_max_file_bytes_fails_the_batch_with_the_reason_and_leaves_nothing(env):
    c = env.client("big")
    batch = create(c, upload(c, [line(k, max_tokens=120) for k in range(60)]))  # ~58 KB of output
    done = wait_end(c, batch.id, timeout=60)
    assert done.status == "failed" and done.output_file_id is None
    (error,) = done.errors.data
    assert error.code == "output_too_large" and "--max-file-bytes" in error.message
    assert done.request_counts.completed < 60  # it stopped feeding once the output could not be written
    # its line results are removed just after it ended (by the sweep, if its runner died in between)
    wait_for(lambda: not (env.store / "batches" / batch.id).exists(), timeout=10, every=0.1)
    assert [f.id for f in c.files.list().data] == [batch.input_file_id]


def test_a_tenants_policy_is_read_again_for_each_line(env):
    c = env.client("pol")
    batch = create(c, upload(c, [line(k, max_tokens=50) for k in range(40)]))  # 5 waves of 8; ~28 KB of output
    wait_for(lambda: c.batches.retrieve(batch.id).request_counts.completed >= 1, timeout=60, every=0.1)
    write_keys(env.keys_file, entries(pol={"models": ["other-model"]}))
    try:
        done = wait_end(c, batch.id, timeout=90)
    finally:
        write_keys(env.keys_file, entries())
    assert done.status == "completed" and done.request_counts.failed > 0
    errors = [json.loads(r) for r in c.files.content(done.error_file_id).text.splitlines()]
    assert {e["response"]["body"]["error"]["code"] for e in errors} == {"model_not_allowed"}


def test_a_tenant_lists_only_its_own_batches_and_files(env):
    a, b, admin = env.client("a2"), env.client("b2", 1), env.client("ops")
    file_id = upload(a, [line(0)])
    made = [create(a, file_id).id for _ in range(2)]
    assert b.batches.list(limit=5).data == []
    page = httpx.get(f"{env.bases[1]}/v1/batches", headers=auth("b2"), timeout=10).json()
    assert page["data"] == [] and page["last_id"] is None and not page["has_more"]  # no other tenant's id
    for after in (made[0], "batch_nobodys"):  # another tenant's id is answered as one that does not exist
        resp = httpx.get(f"{env.bases[0]}/v1/batches", params={"after": after}, headers=auth("b2"), timeout=10)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "after"
    mine = a.batches.list(limit=1)
    assert [x.id for x in mine.data] == [made[1]] and mine.has_more
    assert [x.id for x in a.batches.list(limit=5, after=mine.data[0].id).data] == [made[0]]
    everyone = [x.id for x in admin.batches.list(limit=100).data]
    assert set(made) <= set(everyone)
    for batch_id in made:
        assert wait_end(a, batch_id).status == "completed"
    files = a.files.list()
    outputs = {a.batches.retrieve(i).output_file_id for i in made}
    assert {f.id for f in files.data} == {file_id, *outputs}
    assert [f.id for f in a.files.list(purpose="batch").data] == [file_id]
    first = a.files.list(limit=1, order="asc")
    assert [f.id for f in first.data] == [file_id] and first.has_more
    assert {f.id for f in a.files.list(limit=5, order="asc", after=file_id).data} == outputs
    assert b.files.list().data == []


def test_line_results_of_ended_and_expired_batches_are_swept(env):
    c = env.client("good")
    ended = wait_end(c, create(c, upload(c, [line(0)])).id)
    assert ended.status == "completed"
    strays = [env.store / "batches" / ended.id / "lines" / "00000000.ok",
              env.store / "batches" / "batch_expired0" / "lines" / "00000003.err"]
    for path in strays:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"{}\n")
    wait_for(lambda: not any(p.exists() for p in strays), timeout=15, every=0.2)


def test_a_runner_taking_over_does_not_count_tokens_again(env):
    c = env.client("tok", 1)
    batch = create(c, upload(c, [line(k, max_tokens=120) for k in range(6)]))
    r, keys = env.stack.redis(), env.stack.keys

    def holder() -> str | None:
        """The API process that holds the batch's work entry (its consumer in the `batch` group)."""
        for key in r.scan_iter(f"{keys.namespace}:batch-work*"):
            for row in r.xpending_range(key, "batch", "-", "+", 100):
                entry = r.xrange(key, row["message_id"], row["message_id"])
                if entry and batch.id in entry[0][1]["data"]:
                    return row["consumer"].split("@")[0]
        return None

    # its lines are well under way (and their usage was flushed meanwhile, every 0.2 s): 10 reply entries are 10
    # tokens or more (--stream-flush-ms merges fast steps' tokens into one entry)
    wait_for(lambda: r.xlen(keys.reply(line_uid(batch.id, 0, 0))) >= 10, timeout=30, every=0.05)
    name = wait_for(holder, timeout=10)
    env.stack.kill(name, signal.SIGKILL)
    survivor = env.client("tok", 0 if name == "api2" else 1)
    done = wait_end(survivor, batch.id, timeout=60)
    assert done.status == "completed" and done.request_counts.completed == 6
    out = [json.loads(x) for x in survivor.files.content(done.output_file_id).text.splitlines()]
    generated = sum(x["response"]["body"]["usage"]["completion_tokens"] for x in out)
    assert generated == 6 * 120
    # each line's tokens were charged once, by the lease of the request that ran it, before the batch completed
    assert int(r.hget(keys.usage(), "tok:generated_tokens") or 0) == generated
    # the lines it followed do not stay in the model's queue count (which would hold every batch's feed back)
    wait_for(lambda: r.zcard(keys.queued(MODEL)) == 0, timeout=10, every=0.2)
    env.bases = [env.bases[0 if name == "api2" else 1]] * 2


def test_the_work_streams_keep_only_what_is_to_do_and_the_parked_batch_completes(env, slow):
    slow, c = slow[0], env.client("slow")
    done = wait_end(c, slow[1], timeout=150)  # once its minute's window reset
    assert done.status == "completed" and done.request_counts.completed == 2
    r, keys = env.stack.redis(), env.stack.keys

    def balanced() -> bool:
        ids = r.zrange(keys.batches(), 0, -1)
        ended = ("completed", "failed", "cancelled", "expired")
        active = sum(1 for i in ids if r.hget(keys.batch(i), "status") not in ended)
        queued = sum(r.xlen(k) for k in r.scan_iter(f"{keys.namespace}:batch-work*"))
        return queued == active

    wait_for(balanced, timeout=10, every=0.2)
