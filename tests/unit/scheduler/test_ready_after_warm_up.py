"""A scheduler reports ready (its liveness file and its heartbeat, what the probes and the API read) only after
its engine warmed up: with a real redis-server, the demo model and the very check the chart's probes run."""

from __future__ import annotations

import argparse
import asyncio
import uuid

from rsinfer.operator_commands import healthcheck
from services.scheduler.engine.model_runner import ModelRunner
from services.scheduler.main import build_worker
from shared.settings import SchedulerSettings


async def test_the_health_probe_fails_during_warm_up_and_passes_once_ready(redis_server, random_model_dir,
                                                                          monkeypatch):
    settings = SchedulerSettings(redis_url=redis_server.url, namespace=f"warm{uuid.uuid4().hex[:6]}",
                                 worker_id="scheduler-warm", threads=1, max_kv_tokens=1024, page_size=8)
    probe = argparse.Namespace(role="scheduler", max_stall_s=60.0, ready=False)
    ready = argparse.Namespace(role="scheduler", max_stall_s=60.0, ready=True)
    during_warm_up: list[int] = []
    forward = ModelRunner.forward

    def probing_forward(self, *args, **kw):  # runs in the engine-building thread, which has no event loop
        during_warm_up.append(healthcheck(settings, probe))
        return forward(self, *args, **kw)

    monkeypatch.setattr(ModelRunner, "forward", probing_forward)
    worker = await build_worker(settings, str(random_model_dir), "rsinfer-demo")
    monkeypatch.undo()
    try:
        assert during_warm_up, "no forward ran while the worker was built: the first request would warm it up"
        assert set(during_warm_up) == {1}, "the probe must fail (no liveness file) while the engine warms up"
        await worker.start()
        assert await asyncio.to_thread(healthcheck, settings, probe) == 0
        assert await asyncio.to_thread(healthcheck, settings, ready) == 0  # its heartbeat is in Redis too
        assert not worker.engine.has_work() and worker.engine.stats()["steps"] == 0
    finally:
        await worker.close()
    assert healthcheck(settings, probe) == 1, "a stopped worker's liveness file is gone"


def test_a_synthetic_engines_scheduler_is_built_without_torch(redis_server, random_model_dir):
    """It runs no model: neither torch nor transformers' modelling is imported (a second and ~150 MB less at every
    start, which scale-to-zero and the suite's stacks wait for)."""
    import subprocess
    import sys

    code = ("import asyncio, sys\n"
            "from services.scheduler.main import build_worker\n"
            "from shared.settings import SchedulerSettings\n"
            "settings = SchedulerSettings(engine='synthetic', redis_url=sys.argv[2])\n"
            "asyncio.run(build_worker(settings, sys.argv[1], 'rsinfer-demo'))\n"
            "print(sorted(m for m in ('torch', 'transformers.modeling_utils') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code, str(random_model_dir), redis_server.url], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", (done.stdout, done.stderr[-2000:])
