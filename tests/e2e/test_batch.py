"""The Files and Batch APIs through the official `openai` SDK, on a stack of separate processes (two API
processes, two schedulers) sharing one S3 bucket (moto in server mode): a batch mixing chat, completions and
responses lines with a few bad ones completes with one output line per good line and one error line per bad one;
the same batch with the API process that accepted it and a scheduler SIGKILLed mid-way completes with the same
outputs and runs no line twice; cancel stops it."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys

import httpx
import openai
import pytest

from services.api.batch_api.batch_lines import line_uid
from tests.s3_server import CLIENT_ENV
from tests.support.helpers import wait_for
from tests.support.stack import LIFECYCLE_ENV, MODEL, new_stack, start_replicas

pytestmark = pytest.mark.timeout(300)
GOOD = 61
BAD = ['{"custom_id": "broken", ', '{"method": "POST", "url": "/v1/completions", "body": {}}',
       json.dumps({"custom_id": "bad-url", "method": "POST", "url": "/v1/moderations", "body": {}}),
       json.dumps({"custom_id": "bad-field", "method": "POST", "url": "/v1/chat/completions",
                   "body": {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "frobnicate": 1}})]


@pytest.fixture(scope="module")
def stack(redis_server, demo_model_dir, tmp_path_factory, s3_server):
    """Files in a bucket of a real S3-compatible server (moto), which every process shares."""
    s = new_stack(redis_server, demo_model_dir, tmp_path_factory, "batch")
    # unbuffered: what an API process logged before it was SIGKILLed is in its log (the kill test counts it)
    env = {**LIFECYCLE_ENV, **CLIENT_ENV, "PYTHONUNBUFFERED": "1", "RSINFER_STORAGE_URL": f"s3://{s3_server.new_bucket()}/batch",
           "RSINFER_STORAGE_ENDPOINT_URL": s3_server.url, "RSINFER_STORAGE_ADDRESSING_STYLE": "path",
           "RSINFER_BATCH_CLAIM_IDLE_S": "3", "RSINFER_BATCH_MAX_INFLIGHT": "12", "RSINFER_BATCH_MAX_BACKLOG": "6"}
    try:
        ports = start_replicas(s, {"scheduler": 2}, apis=2, **env)
        s.ports = ports
        yield s
    finally:
        s.stop()


def client(s, k: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{s.ports[k]}/v1", api_key="unused", max_retries=0)


def good_line(k: int) -> dict:
    text = f"Line {k} says"
    kind = k % 3
    if kind == 0:
        return {"custom_id": f"c{k}", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 6,
                         "temperature": 0}}
    if kind == 1:
        return {"custom_id": f"c{k}", "method": "POST", "url": "/v1/completions",
                "body": {"model": MODEL, "prompt": text, "max_tokens": 6, "temperature": 0}}
    return {"custom_id": f"c{k}", "method": "POST", "url": "/v1/responses",
            "body": {"model": MODEL, "input": text, "max_output_tokens": 6, "temperature": 0}}


def rows(max_tokens: int | None = None) -> list[str]:
    """The input file's lines: the good ones, with the bad ones among them."""
    lines = [good_line(k) for k in range(GOOD)]
    if max_tokens:
        for line in lines:
            line["body"]["max_tokens" if "max_tokens" in line["body"] else "max_output_tokens"] = max_tokens
    out = [json.dumps(x) for x in lines]
    for k, bad in enumerate(BAD):
        out.insert(k * 15 + 7, bad)
    return out


def input_file(c: openai.OpenAI, max_tokens: int | None = None) -> str:
    data = "\n".join(rows(max_tokens)).encode()
    return c.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id


def answer_text(row: dict) -> str:
    body = row["response"]["body"]
    if body.get("object") == "response":
        return "".join(p["text"] for o in body["output"] for p in o.get("content", []))
    choice = body["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def results(c: openai.OpenAI, batch) -> tuple[dict[str, str], list[dict]]:
    out = [json.loads(r) for r in c.files.content(batch.output_file_id).text.splitlines()]
    err = [json.loads(r) for r in c.files.content(batch.error_file_id).text.splitlines()]
    return {r["custom_id"]: answer_text(r) for r in out}, err


def wait_done(c: openai.OpenAI, batch_id: str, timeout: float = 240):
    wait_for(lambda: c.batches.retrieve(batch_id).status in ("completed", "failed", "cancelled"), timeout=timeout)
    return c.batches.retrieve(batch_id)


@pytest.fixture(scope="module")
def first_run(stack):
    c = client(stack)
    batch = c.batches.create(input_file_id=input_file(c), endpoint="/v1/chat/completions",
                             completion_window="24h", metadata={"run": "plain"})
    assert batch.status == "validating"
    return wait_done(c, batch.id)


def test_batch_completes_with_an_output_line_per_good_line(stack, first_run):
    b = first_run
    assert b.status == "completed", b
    assert b.request_counts.total == GOOD + len(BAD) and b.request_counts.completed == GOOD
    assert b.request_counts.failed == len(BAD) and b.metadata == {"run": "plain"}
    outputs, errors = results(client(stack, 1), b)
    assert sorted(outputs) == sorted(f"c{k}" for k in range(GOOD))
    assert [e.get("custom_id") for e in errors] == [None, None, "bad-url", "bad-field"]
    assert errors[0]["error"]["line"] == 8 and errors[3]["response"]["status_code"] == 400
    assert "frobnicate" in errors[3]["response"]["body"]["error"]["message"]
    # a line's answer is what the endpoint answers directly
    c = client(stack)
    direct = c.chat.completions.create(**good_line(0)["body"]).choices[0].message.content
    assert outputs["c0"] == direct
    direct = c.completions.create(**good_line(1)["body"]).choices[0].text
    assert outputs["c1"] == direct
    assert outputs["c2"] == c.responses.create(**good_line(2)["body"]).output_text


def test_batches_show_in_metrics_and_inspect(stack, first_run):
    scraped = "".join(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text for port in stack.ports)
    assert 'rsinfer_batches_total{status="completed"} 1.0' in scraped
    assert f'rsinfer_batch_lines_total{{outcome="ok"}} {GOOD}.0' in scraped
    out = subprocess.run([sys.executable, "-m", "rsinfer.cli", "inspect", "--redis-url", stack.redis_url,
                          "--namespace", stack.namespace], capture_output=True, text=True, timeout=60).stdout
    row = next(line for line in out.splitlines() if line.startswith(first_run.id))
    assert row.split()[1:] == ["completed", "/v1/chat/completions", str(GOOD + 4), str(GOOD), "4"]


def test_killing_the_accepting_api_and_a_scheduler_loses_nothing(stack, first_run):
    expected, _ = results(client(stack), first_run)
    c1, c2 = client(stack), client(stack, 1)
    batch = c1.batches.create(input_file_id=input_file(c1), endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(lambda: c2.batches.retrieve(batch.id).request_counts.completed >= 20, timeout=120)
    stack.kill("api1", signal.SIGKILL)
    stack.kill("scheduler1", signal.SIGKILL)
    done = wait_done(c2, batch.id)
    assert done.status == "completed" and done.request_counts.completed == GOOD
    outputs, _ = results(c2, done)
    assert outputs == expected
    # no line was submitted twice: each line's request was queued at most once, by one API process or the other;
    # only the lines the killed process was submitting as it died may have no log line (it logs after the write)
    logs = "".join((stack.log_dir / f"{name}.log").read_text(errors="replace") for name in ("api1", "api2"))
    good = [k for k, row in enumerate(rows()) if row not in BAD]
    assert len(good) == GOOD
    counts = [logs.count(f"uid={line_uid(batch.id, index, 0)} queued") for index in good]
    assert max(counts) == 1 and counts.count(0) <= 12, counts  # 12: --batch-max-inflight


def test_cancel_stops_feeding_and_aborts_what_runs(stack, first_run):
    c = client(stack, 1)
    batch = c.batches.create(input_file_id=input_file(c, max_tokens=2000), endpoint="/v1/chat/completions",
                             completion_window="24h")
    wait_for(lambda: c.batches.retrieve(batch.id).status == "in_progress", timeout=60)
    cancelling = c.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_done(c, batch.id, timeout=60)
    assert done.status == "cancelled" and done.cancelled_at
    assert done.request_counts.completed + done.request_counts.failed < GOOD + len(BAD)
    assert c.batches.cancel(batch.id).status == "cancelled"


def test_files_and_batch_listing(stack, first_run):
    c = client(stack, 1)  # api1 may have been killed by the test before
    f = c.files.create(file=("x.jsonl", io.BytesIO(b'{"a": 1}\n')), purpose="batch")
    assert c.files.retrieve(f.id).bytes == 9 and c.files.content(f.id).read() == b'{"a": 1}\n'
    c.files.delete(f.id)
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(f.id)
    with pytest.raises(openai.BadRequestError):
        c.files.create(file=("x.jsonl", io.BytesIO(b"{}")), purpose="fine-tune")
    with pytest.raises(openai.NotFoundError):
        c.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError):
        c.batches.create(input_file_id=first_run.input_file_id, endpoint="/v1/moderations", completion_window="24h")
    small = c.files.create(file=("s.jsonl", io.BytesIO(json.dumps(good_line(0)).encode())), purpose="batch")
    made = [c.batches.create(input_file_id=small.id, endpoint="/v1/chat/completions", completion_window="24h").id
            for _ in range(2)]
    page = c.batches.list(limit=2)
    assert [b.id for b in page.data] == made[::-1]  # newest first
    assert len(page.data) == 2 and page.has_more
    rest = c.batches.list(limit=100, after=page.data[-1].id)
    ids = [b.id for b in page.data] + [b.id for b in rest.data]
    assert first_run.id in ids and len(ids) == len(set(ids))


def test_embedding_lines_and_output_expires_after(stack, first_run):
    """OpenAI takes /v1/embeddings lines and `output_expires_after` (the output files' lifetime)."""
    c = client(stack, 1)
    rows = [{"custom_id": f"e{k}", "method": "POST", "url": "/v1/embeddings",
             "body": {"model": MODEL, "input": f"text {k}"}} for k in range(3)]
    data = "\n".join(json.dumps(r) for r in rows).encode()
    f = c.files.create(file=("e.jsonl", io.BytesIO(data)), purpose="batch")
    batch = c.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h",
                             output_expires_after={"anchor": "created_at", "seconds": 7200})
    done = wait_done(c, batch.id, timeout=60)
    assert done.status == "completed" and done.request_counts.completed == 3
    out = [json.loads(r) for r in c.files.content(done.output_file_id).text.splitlines()]
    direct = c.embeddings.create(model=MODEL, input="text 0").data[0].embedding
    assert out[0]["response"]["body"]["data"][0]["embedding"] == pytest.approx(direct, abs=1e-4)  # another batch
    output = c.files.retrieve(done.output_file_id)
    assert output.expires_at == output.created_at + 7200
    assert [x.id for x in c.files.list(purpose="batch_output", limit=100).data][:1] == [done.output_file_id]
