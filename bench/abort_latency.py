"""How fast a client's disconnect stops its request: the time from the socket's close to the abort flag in Redis
(the API's part), and to the record's `aborted` status (the scheduler's part), with how many reply entries the
scheduler still published after the flag. The suite checks the order of these events
(tests/e2e/test_cancellation.py); their latencies are measured here, on one stack of the synthetic engine.

    python bench/abort_latency.py [--requests 50] [--step-ms 20] [--resume-window-s 0] [--out ...]

The API's resume window (`--resume-window-s`, 5 s by default) delays the abort of a disconnected stream on
purpose, so that a client can reattach: the bench sets it to 0 unless told otherwise.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.harness import BenchStack  # noqa: E402
from shared.demo_model import ensure_demo_model  # noqa: E402
from shared.keys import Keys  # noqa: E402


def open_stream(port: int, name: str) -> tuple[socket.socket, str]:
    """A streamed chat request on a plain socket, read up to its id; the socket and the request's uid."""
    body = json.dumps({"model": name, "messages": [{"role": "user", "content": "go"}], "max_tokens": 4000,
                       "ignore_eos": True, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    buf = b""
    while b"chatcmpl-" not in buf or b'"object"' not in buf:
        buf += sock.recv(4096)
    return sock, buf.split(b"chatcmpl-")[1][:32].decode()


def until(check, timeout: float = 30.0) -> float:
    """Poll `check` every 0.5 ms; the monotonic time it first held."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(0.0005)
    return time.monotonic()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--step-ms", type=int, default=20)
    ap.add_argument("--resume-window-s", type=float, default=0.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "abort-latency.json"))
    args = ap.parse_args()
    name, keys = "bench-abort", Keys()
    env = {"scheduler": {"RSINFER_ENGINE": "synthetic", "RSINFER_STEP_MS": str(args.step_ms)},
           "api": {"RSINFER_RESUME_WINDOW_S": str(args.resume_window_s)}}
    to_flag, to_aborted, after_flag = [], [], []
    with BenchStack(str(ensure_demo_model()), name, env=env) as stack:
        import redis

        r = redis.Redis.from_url(stack.redis_server.url, decode_responses=True)
        port = stack.ports[0]
        for _ in range(args.requests):
            sock, uid = open_stream(port, name)
            closed = time.monotonic()
            sock.close()
            flagged = until(lambda uid=uid: r.exists(keys.abort(uid)))
            entries = r.xlen(keys.reply(uid))
            aborted = until(lambda uid=uid: r.hget(keys.request(uid), "status") == "aborted")
            to_flag.append((flagged - closed) * 1000)
            to_aborted.append((aborted - closed) * 1000)
            after_flag.append(r.xlen(keys.reply(uid)) - entries)
    figures = {
        "requests": args.requests, "step_ms": args.step_ms, "resume_window_s": args.resume_window_s,
        "disconnect_to_flag_ms": {"p50": round(percentile(to_flag, 0.5), 2), "p99": round(percentile(to_flag, 0.99), 2),
                                  "max": round(max(to_flag), 2)},
        "disconnect_to_aborted_ms": {"p50": round(percentile(to_aborted, 0.5), 2),
                                     "p99": round(percentile(to_aborted, 0.99), 2), "max": round(max(to_aborted), 2)},
        "entries_after_flag": {"max": max(after_flag), "mean": round(sum(after_flag) / len(after_flag), 2)},
    }
    print(json.dumps(figures, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
