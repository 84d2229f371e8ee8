"""`rsinfer inspect`: the load as columns, one line for a Redis it cannot reach, a watch that redraws (the files
that let it run next to `up` without flags: tests/unit/rsinfer/test_local.py)."""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys

import pytest

from rsinfer import operator_commands
from rsinfer.cli import build_parser
from rsinfer.operator_commands import inspect, redacted, worker_tables
from rsinfer.redis_server import free_port
from shared.heartbeats import WorkerInfo
from shared.settings import CommonSettings

pytestmark = pytest.mark.timeout(60)


def test_load_is_shown_as_columns():
    now = 1000.0
    workers = [WorkerInfo("scheduler", "s2@1", "m", now, {"running": 3, "waiting": 0, "last_step_at": now - 1.5,
                                                          "kv_cache_usage": 0.25, "model_info": {"root": "/x"}}),
               WorkerInfo("scheduler", "s1@1", "m", now, {"running": 12, "lora_adapters": ["a", "b"]}),
               WorkerInfo("api", "api@1", "", now, {"inflight": 2, "draining": False})]
    lines = worker_tables(workers, now)
    assert "{" not in "".join(lines)  # no raw JSON
    api, scheduler = lines.index("API"), lines.index("SCHEDULER")
    assert lines[api + 1].split() == ["WORKER", "MODEL", "INFLIGHT", "DRAINING"]
    assert lines[api + 2].split() == ["api@1", "-", "2", "no"]
    # the common figures first, then the others as reported; long names abbreviated
    assert lines[scheduler + 1].split() == ["WORKER", "MODEL", "RUNNING", "WAITING", "LAST_STEP", "LORA_ADAPTERS",
                                            "KV_USAGE"]
    assert lines[scheduler + 2].split() == ["s1@1", "m", "12", "-", "-", "a,b", "-"]
    assert lines[scheduler + 3].split() == ["s2@1", "m", "3", "0", "1.5s", "ago", "-", "0.25"]
    header, row = lines[scheduler + 1], lines[scheduler + 3]
    assert row.index("0.25") == header.index("KV_USAGE")  # aligned under its column


def test_a_wide_load_fits_120_columns_and_names_what_it_leaves_out():
    now = 1000.0
    load = {f"figure_number_{k}": 123456789 for k in range(30)}
    load["running"], load["lora_adapters"] = 7, [f"adapter-{k}" for k in range(40)]
    workers = [WorkerInfo("scheduler", "a-very-long-pod-name-of-a-deployment-7f9c8d6b5-x2x9z@123.abcd", "org/" + "m" *
                          60, now, load)]
    lines = worker_tables(workers, now)
    assert all(len(line) <= 120 for line in lines), max(lines, key=len)
    assert lines[1].split()[:3] == ["WORKER", "MODEL", "RUNNING"]  # the common figures are kept
    assert lines[2].split()[2] == "7" and "…" in lines[2]
    note = " ".join(lines[lines.index(next(ln for ln in lines if ln.startswith("(also in its heartbeat: "))):])
    assert "figure_number_29," in note and note.strip().endswith("lora_adapters)")


def test_a_tensor_parallel_schedulers_ranks_get_a_table():
    ranks = [{"rank": r, "pid": 100 + r, "device": f"cuda:{r}", "weight_bytes": 3 << 29, "kv_tokens": 4096}
             for r in range(2)]
    workers = [WorkerInfo("scheduler", "s1@1", "m", 1000.0, {"running": 1, "tensor_parallel_size": 2,
                                                              "tp_ranks": ranks})]
    lines = worker_tables(workers, 1000.0) + operator_commands.rank_lines(workers)
    assert "{" not in "".join(lines)
    assert "TP_RANKS" not in " ".join(lines) and "TENSOR_PARALLEL_SIZE" in " ".join(lines)
    at = lines.index("TENSOR-PARALLEL RANKS")
    assert lines[at + 1].split() == ["WORKER", "RANK", "PID", "DEVICE", "WEIGHTS_MIB", "KV_TOKENS"]
    assert lines[at + 3].split() == ["s1@1", "1", "101", "cuda:1", "1536.0", "4096"]


def args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"uid": None, "watch": None, "all": False, **kw})


def test_an_unreachable_redis_is_one_line(capsys):
    url = f"redis://:secret@127.0.0.1:{free_port()}/0"
    assert asyncio.run(inspect(CommonSettings(redis_url=url), args())) == 1
    out = capsys.readouterr()
    assert out.out.count("\n") == 1 and "cannot reach Redis at redis://:***@127.0.0.1" in out.out
    assert "secret" not in out.out and "Traceback" not in out.out + out.err
    assert redacted("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_the_cli_says_one_line_too():
    env = {k: v for k, v in os.environ.items() if not k.startswith("RSINFER_")}
    out = subprocess.run([sys.executable, "-m", "rsinfer.cli", "inspect", "--redis-url",
                          f"redis://127.0.0.1:{free_port()}/0"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stderr == "" and len(out.stdout.splitlines()) == 1, out


def test_watch_redraws_until_stopped(redis_server, capsys, monkeypatch):
    settings = CommonSettings(redis_url=redis_server.url, namespace="watch-test")
    drawn, third, real = [], asyncio.Event(), operator_commands.overview

    async def counted(*a, **kw) -> list[str]:
        lines = await real(*a, **kw)
        drawn.append(1)
        if len(drawn) == 3:
            third.set()  # wakes the test once the watch, going on with no await, sleeps before its next redraw
        return lines

    async def watched() -> None:
        task = asyncio.create_task(inspect(settings, args(watch=0.05)))
        await asyncio.wait_for(third.wait(), 30)
        # Stopped as it waits between redraws: a cancel that lands in a Redis call can be lost (Python 3.11's
        # asyncio.wait_for, which redis-py sends commands in), and the watch would go on.
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    monkeypatch.setattr(operator_commands, "overview", counted)
    asyncio.run(watched())
    screens = capsys.readouterr().out.split("\033[H\033[2J")
    assert len(screens) >= 3 and all("UID" in s for s in screens[1:])
    assert build_parser().parse_args(["inspect", "--watch"]).watch == 2.0
    assert build_parser().parse_args(["inspect", "--watch", "0.5"]).watch == 0.5

