"""`rsinfer up` on its own: starts an embedded redis-server, prints its URL, serves, and on SIGTERM
stops every child and the redis-server."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import openai
import pytest
import redis

from shared.keys import Keys
from shared.redis_server import free_port

pytestmark = pytest.mark.timeout(120)


def test_up_with_embedded_redis(demo_model_dir, tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RSINFER_")}
    env.update(OMP_NUM_THREADS="1", RSINFER_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "rsinfer.cli", "up", "--port", str(port), "--model",
                             str(demo_model_dir), "--served-model-name", "demo"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        lines = []
        while not any("ready on" in line for line in lines):
            line = proc.stdout.readline()
            assert line, f"rsinfer up exited early: {lines}"
            lines.append(line)
        url = re.search(r"redis-cli -u (\S+)\)", "".join(lines)).group(1)
        r = redis.Redis.from_url(url)
        assert r.ping()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        assert client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=3).usage.completion_tokens == 3
        roles = sorted(m.decode().split(":")[0] for m in r.zrange(Keys().workers(), 0, -1))
        assert roles == ["api", "detokenizer", "scheduler", "tokenizer"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        time.sleep(0.2)
        with pytest.raises(redis.ConnectionError):
            redis.Redis.from_url(url, socket_connect_timeout=1).ping()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
