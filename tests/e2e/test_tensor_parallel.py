"""Tensor parallelism through the whole pipeline (gloo on CPU): a scheduler of 2 ranks serving the demo model gives
every request the text one rank gives, token for token (greedy and seeded, fp32); each rank holds about half of the
weights; a scheduler stopped stops its ranks; and a rank killed mid-generation takes its group down at once, its
requests finishing on a peer scheduler with the same text. (4 ranks, which replicate the demo model's 2 KV heads,
are tests/unit/engine/test_tensor_parallel.py's.)"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from tests.support.helpers import live_names, wait_for, workers
from tests.support.stack import LIFECYCLE_ENV, MODEL, running_pipeline
from tests.support.streaming import Streamer, body, reference

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

# the same pool and chunk for every scheduler: 16-token chunks make every prompt here a chunked prefill
ENV = {**LIFECYCLE_ENV, "RSINFER_MAX_KV_TOKENS": "4096", "RSINFER_CHUNK_SIZE": "16", "RSINFER_DTYPE": "float32"}
SHARED = "You are a careful assistant. Answer in one short sentence, plainly, without lists. " * 2
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
          "required": ["city", "population"], "additionalProperties": False}


def requests() -> list[dict]:
    def chat(content: str, **extra) -> dict:
        messages = [{"role": "system", "content": SHARED}, {"role": "user", "content": content}]
        return {"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0, **extra}

    return [
        chat("What is a KV cache?", ignore_eos=True),
        chat("What is a KV cache, again?", ignore_eos=True),  # the system prompt's pages: a prefix-cache hit
        chat("Name three colours.", n=2, temperature=0.8, seed=7, ignore_eos=True),
        chat("Give me a city as JSON.", max_tokens=40,
             response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}),
        chat("Tell me about the sea.", stop=["e"], ignore_eos=True),
    ]


def run_all(s) -> list:
    """Each request's choices (text, finish reason), one request at a time (the second hits the first's cache), and
    an embedding (pooling: the last hidden states, whole on rank 0)."""
    out: list = []
    for payload in requests():
        r = httpx.post(f"{s.base_url}/v1/chat/completions", json=payload, timeout=60)
        r.raise_for_status()
        out.append([(c["message"]["content"], c["finish_reason"]) for c in r.json()["choices"]])
    r = httpx.post(f"{s.base_url}/v1/embeddings", json={"model": MODEL, "input": SHARED}, timeout=60)
    r.raise_for_status()
    out.append(r.json()["data"][0]["embedding"])
    return out


def same(got: list, expected: list) -> bool:
    """The texts equal; the embedding within float error (sums in another order)."""
    close = max(abs(a - b) for a, b in zip(got[-1], expected[-1], strict=True)) < 1e-4
    return got[:-1] == expected[:-1] and close


def load_of(s, name: str) -> dict:
    [w] = [w for w in workers(s, "scheduler") if w.id.startswith(f"{name}@")]
    return w.load


def switch(s, old: str, new: str, size: int) -> dict:
    """Start scheduler `new` with `size` ranks, stop `old` once `new` serves; `new`'s heartbeat load."""
    s.start(new, "scheduler", **ENV, RSINFER_TENSOR_PARALLEL_SIZE=str(size))
    wait_for(lambda: new in live_names(s, "scheduler"), timeout=120)
    if old:
        s.stop(names=[old])
    wait_for(lambda: live_names(s, "scheduler") == [new], timeout=30)
    return load_of(s, new)


def gone(pids: list[int]) -> bool:
    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too
            return f.read().split(")")[-1].split()[0] != "Z"

    return not any(alive(p) for p in pids)


def test_tensor_parallel_ranks_give_one_ranks_text_and_die_as_one(redis_server, demo_model_dir, tmp_path_factory):
    with running_pipeline(redis_server, demo_model_dir, tmp_path_factory, "tp", **ENV) as s:
        expected = run_all(s)
        assert len({c[0] for r in expected[:-1] for c in r}) > 3  # varied: the comparison means something
        long_bodies = [body(i, 120) for i in range(2)]
        long_expected = reference(s, long_bodies)
        full_bytes = sum(f.stat().st_size for f in demo_model_dir.glob("*.safetensors"))
        s.send_signal("scheduler1", signal.SIGSTOP)  # the peer that takes over at the end (a start saved)

        load = switch(s, "", "tp2", 2)
        assert same(run_all(s), expected)
        assert load_of(s, "tp2")["prefix_hit_tokens"] > 0
        ranks = load["tp_ranks"]
        assert [r["rank"] for r in ranks] == [0, 1] and {r["device"] for r in ranks} == {"cpu"}
        for r in ranks:  # the norms are whole on every rank: the rest is split
            assert abs(r["weight_bytes"] - full_bytes / 2) < 0.05 * full_bytes, (r, full_bytes)
            assert r["kv_tokens"] > 0
        pids = [r["pid"] for r in ranks]

        runs = [Streamer(s.base_url, b) for b in long_bodies]
        wait_for(lambda: all(len(r.text) > 10 for r in runs), timeout=60)
        s.send_signal("scheduler1", signal.SIGCONT)
        wait_for(lambda: "scheduler1" in live_names(s, "scheduler"), timeout=30)
        killed_at = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        wait_for(lambda: gone(pids), timeout=30)  # rank 0 and every other rank
        assert time.monotonic() - killed_at < 30
        assert s.procs["tp2"].wait(5) != 0
        assert [r.result(120) for r in runs] == long_expected
        records = [s.redis().hgetall(s.keys.request(r.uid)) for r in runs]
        assert all(rec["scheduler"].startswith("scheduler1@") for rec in records), records
