"""rsinfer/supervision.py's restart policy (pure: times in, decisions out) and rsinfer/api_workers.py's parts that
need no worker process: the listening sockets and what a worker is told."""

from __future__ import annotations

import json
import socket

import pytest

from rsinfer.api_workers import listening_sockets, worker_spec
from rsinfer.supervision import RestartPolicy
from shared.settings import ApiSettings


def test_a_dead_worker_starts_again_after_a_doubling_backoff():
    policy = RestartPolicy()
    assert [policy.on_death(t) for t in (0.0, 1.0, 2.0)] == [0.5, 1.0, 2.0]


def test_a_fourth_death_within_the_window_is_a_crash_loop():
    policy = RestartPolicy()
    for t in (0.0, 10.0, 20.0):
        assert policy.on_death(t) is not None
    assert policy.on_death(59.0) is None


def test_deaths_older_than_the_window_are_forgotten():
    policy = RestartPolicy()
    for t in (0.0, 10.0, 20.0):
        policy.on_death(t)
    assert policy.on_death(70.5) == 1.0  # the death at 0 and at 10 left the window: two within it
    assert policy.on_death(79.0) == 2.0  # 20, 70.5, 79


def test_the_backoff_is_capped():
    policy = RestartPolicy(max_deaths=100, max_delay_s=3.0)
    assert [policy.on_death(float(t)) for t in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_sockets_share_the_port_the_first_one_was_given():
    socks = listening_sockets("127.0.0.1", 0, 3, 16)
    try:
        ports = {s.getsockname()[1] for s in socks}
        assert len(ports) == 1 and 0 not in ports
        with socket.create_connection(("127.0.0.1", ports.pop()), timeout=2):
            pass  # the kernel queues it on one of them
    finally:
        for s in socks:
            s.close()


def test_a_taken_port_is_an_error_and_leaves_no_socket():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)  # no SO_REUSEPORT: nobody may share it
        with pytest.raises(OSError):
            listening_sockets("127.0.0.1", taken.getsockname()[1], 2, 16)


def test_a_worker_is_told_its_settings_and_reads_a_secret_file_itself(tmp_path, monkeypatch):
    secret = tmp_path / "password"
    secret.write_text("s3cret\n")
    monkeypatch.setenv("RSINFER_PORT", "1")  # the worker's environment does not override the group's settings
    settings = ApiSettings(redis_password_file=str(secret), port=8123, api_workers=2)
    with socket.socket() as s:
        spec = json.loads(worker_spec(settings, 1, s))
        assert (spec["worker"], spec["fd"]) == (1, s.fileno())
    assert "redis_password" not in spec["settings"]  # the file, not its content
    assert ApiSettings(**spec["settings"]) == settings
