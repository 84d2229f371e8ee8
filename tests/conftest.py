"""Fixtures every test layer shares: the demo checkpoint, made once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.demo_model import ensure_demo_model, make_model
from shared.redis_server import RedisServer
from tests.support.redis_cluster import LocalCluster


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory) -> Path:
    return ensure_demo_model(tmp_path_factory.mktemp("models") / "rsinfer-demo")


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory) -> Path:
    """The demo checkpoint as made before its training (the same tokenizer, template and shape, random weights):
    for tests that compare the engine with transformers token by token on random token ids. Trained weights settle
    into the few patterns they learnt there (a loop of one token, an adapter that changes nothing); random ones
    keep every such comparison sensitive."""
    return make_model(tmp_path_factory.mktemp("random") / "rsinfer-demo", train=False)


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
