"""Fixtures every test layer shares: the demo checkpoint, made once per run (shared by xdist's workers); and how
the run is split between two workers (`make test` runs `-n 2 --dist loadgroup`)."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

import pytest

from rsinfer.redis_server import RedisServer
from shared.demo_model import ensure_demo_model
from tests.support.redis_cluster import LocalCluster
from tests.support.tls_context import one_tls_context_per_process
from tests.support.xdist_groups import apply_groups

# The end-to-end modules that stop, freeze or kill processes or Redis and then wait for recovery within claim and
# heartbeat timings: they run one after the other on one worker (the other worker runs everything else), so that
# two of them never slow each other's recovery. Every other module is a group of its own: its module-scoped
# stack is started once, on the worker that runs it.
SERIAL = frozenset({
    "test_chaos", "test_crash", "test_liveness", "test_poison", "test_redis_aof", "test_redis_oom",
    "test_redis_outage", "test_shutdown", "test_abuse", "test_cluster",
})


# The modules that take longest after those (a minute or more on 2 cores): started early, so that neither worker is
# left with one of them at the end while the other idles.
LONG = ("test_lora", "test_batch", "test_batch_tenants", "test_tenants", "test_up", "test_docs_examples",
        "test_prefix_routing", "test_fair_queue", "test_openai_api")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Group the process tiers by module for `--dist loadgroup` (before xdist reads the marks; unit tests stay
    ungrouped, so they spread over both workers one by one), and order the run so that xdist hands out the
    serial group first, the deploy tier next (it needs no model: the other worker runs it while the first trains
    the demo model, instead of waiting for it), the long modules next and the unit tests last (`make test` turns
    xdist's own reordering, by test count, off)."""
    def rank(item: pytest.Item) -> int:
        module = item.path.stem
        if "unit" in item.path.parts:
            return 4
        if "deploy" in item.path.parts:
            return 1
        return 0 if module in SERIAL else 2 if module in LONG else 3

    grouped = [item for item in items if "unit" not in item.path.parts]
    for item in grouped:
        module = item.path.stem
        item.add_marker(pytest.mark.xdist_group("serial" if module in SERIAL else module))
    apply_groups(config, grouped)  # tests/support/xdist_groups.py says why xdist's own rewrite is not enough
    items.sort(key=rank)  # stable: each module's tests stay together and in their order


@contextlib.contextmanager
def run_wide(tmp_path_factory, name: str) -> Iterator[Path]:
    """A folder shared by every xdist worker of this run (the run's own tmp dir without xdist), held under an
    exclusive lock: what one worker makes there, the others find made."""
    root = tmp_path_factory.getbasetemp()
    if root.name.startswith("popen-gw"):
        root = root.parent
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield root / name


@pytest.fixture(scope="session", autouse=True)
def shared_tls_context() -> Iterator[None]:
    """The tests' HTTP clients share one default TLS context per process (tests/support/tls_context.py says why)."""
    with one_tls_context_per_process():
        yield


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory) -> Path:
    """The trained demo checkpoint, trained once per run (about 17 s of CPU) whichever worker asks first."""
    with run_wide(tmp_path_factory, "models") as folder:
        return ensure_demo_model(folder / "rsinfer-demo")


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory) -> Path:
    """The demo checkpoint as made before its training (the same tokenizer, template and shape, random weights):
    for tests that compare the engine with transformers token by token on random token ids. Trained weights settle
    into the few patterns they learnt there (a loop of one token, an adapter that changes nothing); random ones
    keep every such comparison sensitive."""
    with run_wide(tmp_path_factory, "random") as folder:
        return ensure_demo_model(folder / "rsinfer-demo", train=False)


@pytest.fixture(scope="session")
def redis_server():
    """A real redis-server on a free port for the whole session; tests use their own namespaces."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster():
    """A real Redis Cluster (3 primaries, 3 replicas) on free ports for the whole session. Tests that kill
    nodes start a LocalCluster of their own."""
    with LocalCluster() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server (moto in server mode) on a free port for the whole session; tests use
    buckets of their own (`s3_server.new_bucket()`), clients the credentials in tests/s3_server.py."""
    from tests.s3_server import MotoServer

    with MotoServer() as server:
        yield server
