"""Many tenants on one deployment (docs/operator-guide.md, "Tenants"): named keys from --api-keys-file, request
ownership, quotas shared by two API processes through Redis, rotation without a restart, the policy's 403s, usage
counters.

One stack for the module: tokenizer, scheduler and detokenizer on the synthetic engine (20 ms steps, so a long
request stays open for seconds) and two API processes reading the same keys file.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.helpers import wait_for
from tests.support.stack import MODEL, Stack, new_stack, start_replicas

pytestmark = [pytest.mark.timeout(120)]

A_KEY, B_KEY, B_NEW_KEY, ADMIN_KEY, P_KEY = (f"sk-{name}-{'0' * 24}" for name in (
    "team-a-1", "team-b-1", "team-b-2", "ops-admin", "team-p-1"))
C_KEY, D_KEY, ZERO_KEY, RPM_KEY, S_KEY = (f"sk-{name}-{'0' * 24}" for name in (
    "team-c-1", "team-d-1", "team-zero-1", "team-rpm-1", "team-s-1"))  # one at a time; tpm; refused; a storer
B_MAX = 2
D_TPM = 2000
LEASE_S = 6
RESUME_S = 3  # --resume-window-s: a dropped stream runs on this long for a reattach, holding its slot
STORED_BYTES = 512 << 10  # --max-stored-response-bytes-per-tenant
BIG = "hello " * 10_000  # 60 KB of input: within the bytes the model's context may take, over its tokens


def entries(b_keys: tuple[str, ...] = (B_KEY,)) -> list[dict]:
    b_policy = {"tenant": "team-b", "models": [MODEL], "max_concurrent": B_MAX, "requests_per_minute": 1000,
                "tokens_per_minute": 10_000_000, "priority": [0, 5], "background": False}
    return [{"key": A_KEY, "tenant": "team-a", "background": True},
            *({"key": k, **b_policy} for k in b_keys),
            {"key": C_KEY, "tenant": "team-c", "max_concurrent": 1, "background": True},
            {"key": D_KEY, "tenant": "team-d", "tokens_per_minute": D_TPM},
            {"key": ADMIN_KEY, "tenant": "ops", "admin": True},
            {"key": ZERO_KEY, "tenant": "team-zero", "max_concurrent": 0, "background": True},
            {"key": RPM_KEY, "tenant": "team-rpm", "requests_per_minute": 0},
            {"key": S_KEY, "tenant": "team-s", "background": True},
            {"key": P_KEY, "tenant": "team-p", "priority": [10, 20]}]


def write_keys(path: Path, data: list[dict]) -> None:
    """As a Secret's update: the new file replaces the old at once (never read half-written)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


@pytest.fixture(scope="module")
def tenants(redis_server, demo_model_dir, tmp_path_factory) -> Iterator[tuple[Stack, list[str], Path]]:
    s = new_stack(redis_server, demo_model_dir, tmp_path_factory, "tenants")
    keys_file = s.log_dir / "api-keys.json"
    write_keys(keys_file, entries())
    try:
        ports = start_replicas(s, {}, 2, api_key=ADMIN_KEY, RSINFER_API_KEYS_FILE=str(keys_file),
                               RSINFER_API_KEYS_CHECK_S="0.2", RSINFER_ENGINE="synthetic", RSINFER_STEP_MS="20",
                               RSINFER_QUOTA_LEASE_S=str(LEASE_S), RSINFER_USAGE_FLUSH_S="0.5",
                               RSINFER_RESUME_WINDOW_S=str(RESUME_S),
                               RSINFER_MAX_STORED_RESPONSE_BYTES_PER_TENANT=str(STORED_BYTES))
        yield s, [f"http://127.0.0.1:{p}" for p in ports], keys_file
    finally:
        s.stop()


@pytest.fixture(autouse=True)
def slots_freed(tenants) -> Iterator[None]:
    """Streams a test leaves run on until their resume window ends them, and hold their tenants' slots until
    then: the next test starts once they ended."""
    yield
    s = tenants[0]
    if "api2" in s.procs and s.procs["api2"].poll() is None:
        wait_for(lambda: all(s.redis().zcard(s.keys.quota_slots(t)) == 0 for t in ("team-b", "team-c")),
                 timeout=RESUME_S + 15, every=0.1)


def client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)


def chat(base: str, key: str, max_tokens: int = 4, **extra):
    return client(base, key).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=max_tokens, **extra)


@contextlib.contextmanager
def open_stream(base: str, key: str, max_tokens: int = 3000, **extra) -> Iterator[str]:
    """A long stream, open (its first chunk read) until the block ends; its response id."""
    stream = chat(base, key, max_tokens, stream=True, extra_body={"ignore_eos": True, **extra})
    try:
        yield next(iter(stream)).id
    finally:
        stream.close()


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_another_tenant_finds_no_request_of_a_through_either_process_and_an_admin_does(tenants):
    _, (api1, api2), _ = tenants
    with open_stream(api1, A_KEY, background=True) as rid:
        uid = rid.removeprefix("chatcmpl-")
        for base in (api1, api2):
            for ident in (rid, uid):
                for method, path, headers in (("GET", f"/v1/requests/{ident}", {}),
                                              ("GET", f"/v1/requests/{ident}/stream", {"Last-Event-ID": "0-1"}),
                                              ("GET", f"/v1/requests/{ident}/stream", {}),
                                              ("DELETE", f"/v1/requests/{ident}", {})):
                    resp = httpx.request(method, base + path, headers={**auth(B_KEY), **headers}, timeout=10)
                    assert resp.status_code == 404, (base, method, path, resp.text)
                    assert resp.json()["error"]["code"] == "request_not_found"  # as for a uid nobody made
        mine = httpx.get(f"{api2}/v1/requests/{uid}", headers=auth(A_KEY), timeout=10)
        assert mine.status_code == 200 and mine.json()["tenant"] == "team-a"
        record = httpx.get(f"{api2}/v1/requests/{rid}", headers=auth(ADMIN_KEY), timeout=10).json()
        assert record["tenant"] == "team-a" and record["status"] in ("queued", "running")
        assert A_KEY not in json.dumps(record)
        with httpx.stream("GET", f"{api2}/v1/requests/{uid}/stream", headers=auth(ADMIN_KEY), timeout=30) as resp:
            assert resp.status_code == 200
            assert any(line.startswith("data: {") for line in resp.iter_lines())
            # the admin reads on and aborts it below, through the other process
            aborted = httpx.delete(f"{api1}/v1/requests/{uid}", headers=auth(ADMIN_KEY), timeout=10)
            assert aborted.status_code == 200 and aborted.json()["aborted"] is True
        wait_for(lambda: httpx.get(f"{api1}/v1/requests/{uid}", headers=auth(A_KEY), timeout=10).json()["status"]
                 == "aborted", timeout=20, every=0.2)


def assert_rate_limited(base: str) -> None:
    with pytest.raises(openai.RateLimitError) as e:
        chat(base, B_KEY)
    h = e.value.response.headers
    assert int(h["retry-after"]) >= 1
    assert (h["x-ratelimit-limit-concurrent"], h["x-ratelimit-remaining-concurrent"]) == (str(B_MAX), "0")
    assert h["x-ratelimit-limit-requests"] == "1000" and int(h["x-ratelimit-remaining-requests"]) < 1000
    assert h["x-ratelimit-reset-requests"].endswith("s")
    assert h["x-ratelimit-limit-tokens"] == "10000000" and h["x-ratelimit-reset-tokens"].endswith("s")
    assert int(h["x-ratelimit-remaining-tokens"]) <= 10_000_000
    assert e.value.response.json()["error"]["code"] == "rate_limit_exceeded"


def test_past_b_s_concurrency_b_gets_429s_on_both_processes_and_a_is_unaffected(tenants):
    s, (api1, api2), _ = tenants
    with open_stream(api1, B_KEY), open_stream(api2, B_KEY):
        assert_rate_limited(api1)
        assert_rate_limited(api2)
        assert chat(api2, A_KEY).choices[0].finish_reason == "length"
        assert chat(api1, A_KEY).choices[0].finish_reason == "length"
    # the streams' clients left: their requests end when nobody reattached within the resume window, and their
    # slots with them
    slots = s.keys.quota_slots("team-b")
    wait_for(lambda: s.redis().zcard(slots) == 0, timeout=RESUME_S + 10, every=0.05)
    assert _admitted(api2)
    with open_stream(api2, B_KEY), open_stream(api1, B_KEY):  # both slots free again
        assert_rate_limited(api2)


def _admitted(base: str) -> bool:
    try:
        chat(base, B_KEY)
    except openai.RateLimitError:
        return False
    return True


def test_finished_and_refused_requests_hold_no_slot(tenants):
    s, (api1, api2), _ = tenants
    for _ in range(3 * B_MAX):  # finished (non-stream, stream) and refused ones, through both
        chat(api1, B_KEY)
        list(chat(api2, B_KEY, stream=True))
        with pytest.raises(openai.PermissionDeniedError):
            chat(api1, B_KEY, extra_body={"priority": 9})
    # a stream's slot is freed once its last byte is sent, which its client may see a moment before
    slots = s.keys.quota_slots("team-b")
    wait_for(lambda: s.redis().zcard(slots) == 0, timeout=5, every=0.05)
    with open_stream(api1, B_KEY), open_stream(api2, B_KEY):
        assert_rate_limited(api1)


def test_an_aborted_or_timed_out_request_frees_its_slot(tenants):
    s, (api1, api2), _ = tenants
    slots = s.keys.quota_slots("team-b")
    stream = chat(api1, B_KEY, 3000, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    uid = next(chunks).id.removeprefix("chatcmpl-")
    assert s.redis().zcard(slots) == 1
    aborted = httpx.delete(f"{api2}/v1/requests/{uid}", headers=auth(B_KEY), timeout=10)  # its own: allowed
    assert aborted.status_code == 200
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "abort"
    wait_for(lambda: s.redis().zcard(slots) == 0, timeout=10, every=0.05)
    stream.close()
    with pytest.raises(openai.APIStatusError) as e:  # its deadline passes while it generates
        chat(api2, B_KEY, 3000, extra_body={"ignore_eos": True, "timeout": 1})
    assert e.value.status_code == 504
    wait_for(lambda: s.redis().zcard(slots) == 0, timeout=10, every=0.05)


@pytest.mark.parametrize(("extra", "field"), [({"priority": 6}, "priority"), ({"priority": -1}, "priority"),
                                              ({"background": True}, "background")])
def test_what_b_s_policy_does_not_allow_is_a_403_naming_the_field(tenants, extra, field):
    _, (api1, _), _ = tenants
    with pytest.raises(openai.PermissionDeniedError) as e:
        chat(api1, B_KEY, extra_body=extra)
    assert e.value.response.json()["error"]["param"] == field
    chat(api1, A_KEY, extra_body=extra)  # A's policy allows any priority and background


def _queued_priorities(s: Stack, call) -> list[int]:
    """`call()`, and the priorities of the jobs team-p's requests queued meanwhile (its model's tokenize stream)."""
    r, stream = s.redis(), s.keys.tokenize(MODEL)
    last = r.xrevrange(stream, count=1)
    call()
    entries = r.xrange(stream, min=f"({last[0][0]}" if last else "-", count=100_000)
    jobs = [json.loads(fields["data"]) for _, fields in entries]
    return [job.get("priority", 0) for job in jobs if job.get("tenant") == "team-p"]


def test_every_job_runs_within_its_keys_priority_range_on_every_endpoint(tenants):
    """A key of [10, 20] needs no `priority`: its jobs run at 10 (the end nearest the default 0), on chat and on
    the endpoints without a `priority` field (embeddings, score, responses); one it sends outside is a 403."""
    s, (api1, api2), _ = tenants
    p = client(api1, P_KEY)

    def post(path: str, body: dict) -> None:
        """Queued, then answered by the synthetic engine with its 400 (it computes no embeddings or scores)."""
        resp = httpx.post(f"{api2}{path}", headers=auth(P_KEY), timeout=30, json={"model": MODEL, **body})
        assert resp.status_code == 400 and "need the paged engine" in resp.text, resp.text

    assert _queued_priorities(s, lambda: chat(api1, P_KEY)) == [10]
    assert _queued_priorities(s, lambda: chat(api2, P_KEY, extra_body={"priority": 15})) == [15]
    assert _queued_priorities(s, lambda: post("/v1/embeddings", {"input": ["one", "two"]})) == [10, 10]
    assert _queued_priorities(s, lambda: post("/v1/score", {"query": "q", "items": ["a"],
                                                            "label_token_ids": [1, 2]})) == [10]
    assert _queued_priorities(s, lambda: p.responses.create(model=MODEL, input="hi", max_output_tokens=2)) == [10]
    for bad in (0, 21):
        with pytest.raises(openai.PermissionDeniedError) as e:
            chat(api2, P_KEY, extra_body={"priority": bad})
        assert e.value.response.json()["error"]["param"] == "priority"


def test_a_model_outside_the_policy_is_a_403_and_not_listed(tenants):
    _, (api1, _), _ = tenants
    resp = httpx.post(f"{api1}/generate", headers=auth(B_KEY), timeout=10,
                      json={"model": "other-model", "text": "x", "priority": 1})
    assert resp.status_code == 403 and resp.json()["error"]["param"] == "model"
    resp = httpx.post(f"{api1}/generate", headers=auth(B_KEY), timeout=10, json={"text": "x", "priority": 7})
    assert resp.status_code == 403 and resp.json()["error"]["param"] == "priority"
    assert [m.id for m in client(api1, B_KEY).models.list()] == [MODEL]


def test_a_rotated_key_is_honoured_without_restart_and_a_removed_one_refused(tenants):
    _, apis, keys_file = tenants
    try:
        write_keys(keys_file, entries((B_KEY, B_NEW_KEY)))  # both valid while clients move over
        for base in apis:
            wait_for(lambda base=base: _accepted(base, B_NEW_KEY), timeout=10, every=0.2)
            assert _accepted(base, B_KEY)
        write_keys(keys_file, entries((B_NEW_KEY,)))
        for base in apis:
            wait_for(lambda base=base: not _accepted(base, B_KEY), timeout=10, every=0.2)
            with pytest.raises(openai.AuthenticationError):
                chat(base, B_KEY)
            assert _accepted(base, B_NEW_KEY)
    finally:
        write_keys(keys_file, entries())
        for base in apis:
            wait_for(lambda base=base: _accepted(base, B_KEY), timeout=10, every=0.2)


def _accepted(base: str, key: str) -> bool:
    try:
        client(base, key).models.list()
    except openai.AuthenticationError:
        return False
    return True


def test_operator_endpoints_need_an_admin_key_and_metrics_stay_open(tenants):
    _, (api1, _), _ = tenants
    body = {"lora_name": "x", "lora_path": "/nonexistent"}
    resp = httpx.post(f"{api1}/v1/load_lora_adapter", headers=auth(B_KEY), json=body, timeout=10)
    assert resp.status_code == 403 and resp.json()["error"]["code"] == "admin_required"
    resp = httpx.post(f"{api1}/v1/load_lora_adapter", headers=auth(ADMIN_KEY), json=body, timeout=10)
    assert resp.status_code not in (401, 403), resp.text  # past the guard: the adapter's own checks answer
    assert httpx.get(f"{api1}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{api1}/metrics", timeout=10).status_code == 200  # --metrics-open (the default)


def test_usage_is_counted_per_tenant_in_redis_metrics_and_inspect(tenants):
    s, (api1, api2), _ = tenants
    r = s.redis()
    before = {k: int(v) for k, v in r.hgetall(s.keys.usage()).items()}
    chat(api1, B_KEY)  # team-b's series on api1 too, whichever tests ran before
    usage = chat(api1, A_KEY, max_tokens=7).usage
    chat(api2, A_KEY, max_tokens=5)

    def counted() -> dict:
        now = {k: int(v) for k, v in r.hgetall(s.keys.usage()).items()}
        return {k: now.get(k, 0) - before.get(k, 0) for k in now if k.startswith("team-a:")}

    wait_for(lambda: counted().get("team-a:generated_tokens") == 12, timeout=10, every=0.1)
    got = counted()
    assert got["team-a:requests"] == 2 and got["team-a:prompt_tokens"] == 2 * usage.prompt_tokens
    metrics = httpx.get(f"{api1}/metrics", headers=auth(ADMIN_KEY), timeout=10).text
    assert 'rsinfer_tenant_generated_tokens_total{tenant="team-a"}' in metrics
    assert 'rsinfer_tenant_requests_total{tenant="team-b"}' in metrics
    # without a key (the open /metrics) or with a tenant's: every series but the tenants', no tenant's name
    for headers in ({}, auth(A_KEY)):
        metrics = httpx.get(f"{api1}/metrics", headers=headers, timeout=10)
        assert metrics.status_code == 200 and "rsinfer_http_requests_total" in metrics.text
        assert "rsinfer_tenant_" not in metrics.text and "team-a" not in metrics.text and "team-b" not in metrics.text
    assert httpx.get(f"{api1}/metrics", headers=auth("sk-not-a-key-" + "0" * 24), timeout=10).status_code == 401
    out = subprocess.run([sys.executable, "-m", "rsinfer.cli", "inspect", "--redis-url", s.redis_url,
                          "--namespace", s.namespace], capture_output=True, text=True, timeout=60, check=True).stdout
    row = next(line for line in out.splitlines() if line.startswith("team-a "))
    total = {k: int(v) for k, v in r.hgetall(s.keys.usage()).items()}
    assert row.split()[1:] == [str(total.get(f"team-a:{c}", 0)) for c in ("requests", "prompt_tokens", "cached_tokens",
                                                                      "generated_tokens")]


def test_responses_files_and_batches_belong_to_their_tenant(tenants):
    _, (api1, api2), _ = tenants
    a1, b2, admin = client(api1, A_KEY), client(api2, B_KEY), client(api2, ADMIN_KEY)
    r = a1.responses.create(model=MODEL, input="hi", max_output_tokens=4)
    for call in (lambda: b2.responses.retrieve(r.id), lambda: b2.responses.input_items.list(r.id),
                 lambda: b2.responses.delete(r.id),
                 lambda: b2.responses.create(model=MODEL, input="and?", previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert admin.responses.retrieve(r.id).output_text == r.output_text
    assert client(api2, A_KEY).responses.create(model=MODEL, input="and?", previous_response_id=r.id,
                                                max_output_tokens=2).previous_response_id == r.id
    bg = a1.responses.create(model=MODEL, input="long", max_output_tokens=3000, background=True)
    with pytest.raises(openai.NotFoundError):
        b2.responses.cancel(bg.id)
    assert client(api2, A_KEY).responses.cancel(bg.id).status == "cancelled"
    line = {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}}
    f = a1.files.create(file=("in.jsonl", json.dumps(line).encode()), purpose="batch")
    for call in (lambda: b2.files.retrieve(f.id), lambda: b2.files.content(f.id), lambda: b2.files.delete(f.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.PermissionDeniedError):  # team-b's policy has no background: no batches
        b2.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    batch = a1.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (lambda: b2.batches.retrieve(batch.id), lambda: b2.batches.cancel(batch.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert batch.id not in [b.id for b in b2.batches.list(limit=100).data]
    assert batch.id in [b.id for b in admin.batches.list(limit=100).data]
    wait_for(lambda: a1.batches.retrieve(batch.id).status == "completed", timeout=60, every=0.3)
    done = client(api2, A_KEY).batches.retrieve(batch.id)
    assert done.request_counts.completed == 1
    assert json.loads(a1.files.content(done.output_file_id).text)["custom_id"] == "x"
    with pytest.raises(openai.NotFoundError):
        b2.files.content(done.output_file_id)
    uid = json.loads(a1.files.content(done.output_file_id).text)["response"]["request_id"]
    assert httpx.get(f"{api1}/v1/requests/{uid}", headers=auth(A_KEY), timeout=10).json()["tenant"] == "team-a"


def _reattach(base: str, key: str, uid: str) -> list[dict]:
    """The chunks of a reattached stream, read to its end."""
    chunks = []
    with httpx.stream("GET", f"{base}/v1/requests/{uid}/stream", headers=auth(key), timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    return chunks


def _usage(s: Stack, tenant: str) -> dict[str, int]:
    return {k.split(":", 1)[1]: int(v) for k, v in s.redis().hgetall(s.keys.usage()).items()
            if k.startswith(f"{tenant}:")}


def test_a_dropped_and_reattached_stream_keeps_its_slot_and_its_tokens_are_counted(tenants):
    """The lease belongs to the request, not to the HTTP request that submitted it: streams whose clients left
    and were followed again from the other process still hold their slots, and what the stages generated is
    charged, not what the submitter read."""
    s, (api1, api2), _ = tenants
    before = _usage(s, "team-b")
    uids, followers = [], []
    with ThreadPoolExecutor(B_MAX) as pool:
        for _ in range(B_MAX):
            with open_stream(api1, B_KEY, max_tokens=150) as rid:  # one chunk read, then the client leaves
                uids.append(rid.removeprefix("chatcmpl-"))
            followers.append(pool.submit(_reattach, api2, B_KEY, uids[-1]))
        wait_for(lambda: all(s.redis().hget(s.keys.request(u), "attached") == "1" for u in uids), timeout=10)
        assert_rate_limited(api1)
        assert_rate_limited(api2)
        for follower in followers:
            assert follower.result()[-1]["choices"][-1]["finish_reason"] == "length"
    records = [s.redis().hgetall(s.keys.request(uid)) for uid in uids]
    assert [int(r["generated_tokens"]) for r in records] == [150] * B_MAX
    slots = s.keys.quota_slots("team-b")
    wait_for(lambda: s.redis().zcard(slots) == 0, timeout=10, every=0.05)
    wait_for(lambda: _usage(s, "team-b").get("generated_tokens", 0) - before.get("generated_tokens", 0)
             == 150 * B_MAX, timeout=10, every=0.1)
    assert _admitted(api2)


def test_a_background_request_holds_its_slot_after_its_client_left(tenants):
    _, (api1, api2), _ = tenants
    with open_stream(api1, C_KEY, background=True) as rid:
        uid = rid.removeprefix("chatcmpl-")
    with pytest.raises(openai.RateLimitError):  # it runs on with nobody attached: its slot is still held
        chat(api2, C_KEY)
    assert httpx.delete(f"{api2}/v1/requests/{uid}", headers=auth(C_KEY), timeout=10).status_code == 200

    def admitted() -> bool:
        try:
            chat(api1, C_KEY)
        except openai.RateLimitError:
            return False
        return True

    wait_for(admitted, timeout=15, every=0.25)


def test_tokens_per_minute_reserves_max_tokens_at_admission(tenants):
    """Concurrent requests cannot together run past the tenant's tokens per minute: each reserves its max_tokens;
    what an aborted one did not use comes back."""
    s, (api1, api2), _ = tenants
    with open_stream(api1, D_KEY, max_tokens=1500) as rid:
        with pytest.raises(openai.RateLimitError) as e:
            chat(api2, D_KEY, max_tokens=1000)
        assert "tokens_per_minute" in e.value.message
        assert int(e.value.response.headers["x-ratelimit-remaining-tokens"]) < 1000
        uid = rid.removeprefix("chatcmpl-")
    # its client left: it ends within the resume window, and the tokens it did not generate are refunded
    wait_for(lambda: s.redis().hget(s.keys.request(uid), "status") == "aborted", timeout=RESUME_S + 10, every=0.1)

    def admitted() -> bool:
        try:
            with open_stream(api2, D_KEY, max_tokens=1000):
                return True
        except openai.RateLimitError:
            return False

    wait_for(admitted, timeout=10, every=0.25)
    with pytest.raises(openai.RateLimitError) as e:
        chat(api1, D_KEY, max_tokens=D_TPM + 1)
    assert e.value.response.headers["x-should-retry"] == "false"


def test_a_request_without_max_tokens_reserves_the_model_s_default_budget(tenants):
    """What an omitted max_tokens reserves of tokens_per_minute is what the tokenizer gives such a request, the
    model's default budget (the demo checkpoint's 256), not its context (4,096, more than team-d's 2,000 a minute:
    every such request was a 429)."""
    _, (api1, _), _ = tenants

    def served() -> bool:
        try:
            return bool(client(api1, D_KEY).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hello"}]).choices)
        except openai.RateLimitError as e:  # the bucket refills from the test before: only a shortfall waits
            assert int(e.response.headers["x-ratelimit-remaining-tokens"]) < 256, e.message
            return False

    wait_for(served, timeout=20, every=0.5)


def test_a_refused_tenant_stores_nothing(tenants):
    """Responses refused by the tenant's quota (no concurrency at all; no requests this minute) write nothing:
    no stored response, no count, Redis's memory as it was."""
    s, apis, _ = tenants
    r = s.redis()
    before, memory = set(r.scan_iter(f"{s.namespace}:resp*")), r.info("memory")["used_memory"]
    for key, background in ((ZERO_KEY, False), (ZERO_KEY, True), (RPM_KEY, False)):
        for k in range(10):
            resp = httpx.post(f"{apis[k % 2]}/v1/responses", headers=auth(key), timeout=30, json={
                "model": MODEL, "input": BIG, "max_output_tokens": 4, "background": background})
            assert resp.status_code == 429, resp.text[:300]
    assert set(r.scan_iter(f"{s.namespace}:resp*")) == before
    assert not [k for k in r.scan_iter(f"{s.namespace}:stored:*") if "team-zero" in k or "team-rpm" in k]
    assert r.info("memory")["used_memory"] - memory < 1 << 20


def test_a_tenant_past_its_stored_bytes_gets_a_400_and_another_still_stores(tenants):
    _, (api1, api2), _ = tenants
    storer = client(api1, S_KEY)
    ids = []
    with pytest.raises(openai.BadRequestError) as e:  # each ends failed (too many tokens), its input stored
        for _ in range(STORED_BYTES // len(BIG) + 2):
            ids.append(storer.responses.create(model=MODEL, input=BIG, max_output_tokens=1, background=True).id)
    err = e.value.response.json()["error"]
    assert (err["code"], err["param"]) == ("stored_responses_limit", "store")
    assert "--max-stored-response-bytes-per-tenant" in err["message"]
    assert len(ids) >= STORED_BYTES // len(BIG) - 2
    mine = client(api2, A_KEY).responses.create(model=MODEL, input="hi", max_output_tokens=2)
    assert client(api1, A_KEY).responses.retrieve(mine.id).output_text == mine.output_text
    assert storer.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False).status == "incomplete"
    client(api2, S_KEY).responses.delete(ids[0])  # room again
    storer.responses.create(model=MODEL, input=BIG, max_output_tokens=1, background=True)


def test_another_tenants_response_is_answered_404_without_reading_it(tenants):
    """The owner is checked before the stored response is read: asking for another tenant's 60 KB response
    makes Redis send no more than asking for one that does not exist."""
    s, (api1, api2), _ = tenants
    a = client(api1, A_KEY)
    big = a.responses.create(model=MODEL, input=BIG, max_output_tokens=1, background=True)
    record = f"{api1}/v1/requests/{big.id.removeprefix('resp_')}"
    wait_for(lambda: httpx.get(record, headers=auth(A_KEY), timeout=10).json()["status"] == "failed", timeout=30,
             every=0.1)  # the tokenizer refused it (too many tokens); its 60 KB input is stored
    r = s.redis()

    def sent(rid: str) -> int:
        before = r.info("stats")["total_net_output_bytes"]
        for _ in range(5):
            for method, path in (("GET", ""), ("GET", "/input_items"), ("POST", "/cancel"), ("DELETE", "")):
                resp = httpx.request(method, f"{api2}/v1/responses/{rid}{path}", headers=auth(B_KEY), timeout=10)
                assert resp.status_code == 404, resp.text[:200]
        return r.info("stats")["total_net_output_bytes"] - before

    unknown, other = sent("resp_" + "0" * 24), sent(big.id)
    assert other - unknown < 20 * len(BIG) // 4, (other, unknown)
    assert a.responses.retrieve(big.id).status == "failed"


def test_a_crashed_api_processs_slots_are_freed_once_its_requests_ended(tenants):
    """Last: it kills the second API process. Its streams are aborted by the scheduler (their owner is gone); the
    next admission refused for concurrency finds their records ended and frees their slots."""
    s, (api1, api2), _ = tenants
    streams = [chat(api2, B_KEY, 3000, stream=True, extra_body={"ignore_eos": True}) for _ in range(B_MAX)]
    for st in streams:
        next(iter(st))
    s.kill("api2")
    for st in streams:
        with contextlib.suppress(Exception):
            st.close()
    assert_rate_limited(api1)
    wait_for(lambda: _admitted(api1), timeout=60, every=0.25)


@pytest.mark.parametrize("command", ["api", "up"])
@pytest.mark.parametrize(("keys", "env", "says"), [
    ([{"key": "sk-short", "tenant": "a"}], {}, "keys[0].key: a string of at least 32 characters"),
    ([{"key": A_KEY, "tenant": "a"}, {"key": B_KEY, "tenant": "default"}], {}, "keys[1].tenant: `default` is "
     "reserved"),
    ([{"key": A_KEY, "tenant": "a", "max_concurrent": "eight"}], {}, "keys[0].max_concurrent"),
    ([], {"RSINFER_API_KEY": "sk-short"}, "--api-key (RSINFER_API_KEY, --api-key-file): a string of at least 32"),
])
def test_a_bad_keys_file_or_key_stops_the_start_with_one_line(tmp_path, command, keys, env, says):
    """`rsinfer api` and `rsinfer up`: exit status 2 and one line naming the entry and field, no traceback
    (`up` says it before it starts anything)."""
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(keys))
    args = ["--api-keys-file", str(path)] if keys else []
    proc = subprocess.run([sys.executable, "-m", "rsinfer.cli", command, *args, "--port", "0", "--redis-url",
                           "redis://127.0.0.1:1/0"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and says in lines[0], (proc.returncode, lines)
    assert "Traceback" not in proc.stderr and "sk-short" not in lines[0]
