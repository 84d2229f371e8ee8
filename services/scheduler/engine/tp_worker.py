"""A tensor-parallel worker rank (1..N-1): started by the scheduler process (rank 0, tp_group.py), it loads and
shards the model, keeps its share of the KV cache and runs every step rank 0 broadcasts, until rank 0 stops it
or goes away. It reads its settings as JSON on stdin.

    python -m services.scheduler.engine.tp_worker RANK < payload.json
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time

import torch

from services.scheduler.engine.factory import load_shard, rank_device, torch_threads
from services.scheduler.engine.tp_group import WATCH_EVERY_S, StepChannel, agree_pages, exchange_info, init_ranks
from services.scheduler.engine.tp_shard import weight_bytes
from shared.settings import SchedulerSettings

log = logging.getLogger("rsinfer.tp_worker")


def watch_parent(parent: int) -> None:
    """Exit when rank 0 is gone (re-parented), whatever this rank is doing."""
    while os.getppid() == parent:
        time.sleep(WATCH_EVERY_S)
    log.error("rank 0 (pid %d) is gone; exiting", parent)
    os._exit(1)


def serve(rank: int, payload: dict) -> None:
    from services.scheduler.engine.config import make_backend
    from services.scheduler.engine.kv_cache import KVCache
    from services.scheduler.engine.model_geometry import attention_geometry
    from services.scheduler.engine.model_runner import ModelRunner

    settings = SchedulerSettings.model_validate(payload["settings"])
    world = int(payload["world"])
    torch.set_num_threads(torch_threads(settings.threads))
    device = rank_device(settings.device, rank)
    groups = init_ranks(rank, world, int(payload["port"]), device, settings.tp_timeout_s)
    model = load_shard(settings, payload["model_path"], device, rank, groups)
    exchange_info(groups.control, device, weight_bytes(model))
    log.info("rank %d/%d on %s: %.1f MiB of weights", rank, world, device, weight_bytes(model) / 2**20)
    pages = agree_pages(groups.control, 0)
    dtype = next(model.parameters()).dtype
    kv = KVCache(attention_geometry(model).kv_shape(settings.page_size), pages, dtype, device)
    runner = ModelRunner(model, make_backend("auto", kv, model, dtype), settings.page_size)
    channel = StepChannel(device, groups)
    while (step := channel.receive()) is not None:
        if step.zero:
            kv.zero_pages(step.zero)
        runner.run_packed(step.rows, step.ids, step.keep)
    log.info("rank %d stopped by rank 0", rank)


def main() -> None:
    rank = int(sys.argv[1])
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s tp-rank{rank} %(name)s: %(message)s")
    for sig in (signal.SIGTERM, signal.SIGINT):  # a signal to the pod's process group: rank 0 drains, then stops us
        signal.signal(sig, signal.SIG_IGN)
    parent = os.getppid()
    threading.Thread(target=watch_parent, args=(parent,), name="watch-parent", daemon=True).start()
    payload = json.loads(sys.stdin.read())
    try:
        serve(rank, payload)
    except Exception:  # a failed collective (rank 0 died or timed out) or load: the group goes down as one
        log.exception("rank %d failed", rank)
        logging.shutdown()
        os._exit(1)
    os._exit(0)  # the process group's threads would keep an orderly exit waiting


if __name__ == "__main__":
    main()
