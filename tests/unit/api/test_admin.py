"""services/api/edge/admin.py's control socket: an API process whose port is taken leaves the running one's socket
alone, and each removes only what it made (its socket, and its directory once empty)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from services.api.edge.admin import AdminSocket, admin_socket_path, call

pytestmark = pytest.mark.timeout(30)


def _service() -> SimpleNamespace:
    return SimpleNamespace(requests=SimpleNamespace(inflight={}), drain=SimpleNamespace(drain_for=lambda s: None))


async def test_a_second_process_does_not_take_a_live_socket(tmp_path: Path):
    path = tmp_path / "rsinfer-api-8000" / "control.sock"
    first = AdminSocket(_service(), path, 60.0, own_dir=True)
    await first.start()
    second = AdminSocket(_service(), path, 60.0, own_dir=True)
    with pytest.raises(RuntimeError, match="another API process serves the control socket"):
        await second.start()
    await second.close()  # its start failed: nothing of it to remove
    assert (await asyncio.to_thread(call, path, "drain"))["draining"] is True
    await first.close()
    assert not path.parent.exists()  # the directory it made goes with it


async def test_a_dead_predecessors_socket_is_replaced_and_a_named_directory_kept(tmp_path: Path):
    path = tmp_path / "mine" / "control.sock"
    path.parent.mkdir(mode=0o700)
    path.touch()  # what a crashed process left: nobody listens on it
    socket = AdminSocket(_service(), path, 60.0)
    await socket.start()
    await socket.close()
    assert not path.exists() and path.parent.exists()  # --admin-socket named it: not ours to remove


def test_the_default_path_is_per_port():
    assert admin_socket_path("", 8001).parent.name == "rsinfer-api-8001"
