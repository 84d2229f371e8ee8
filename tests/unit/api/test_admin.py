"""services/api/edge/admin.py's control socket: an API process whose port is taken leaves the running one's socket
alone, and each removes only what it made (its socket, and its directory once empty)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from services.api.edge.admin import AdminSocket, admin_socket_path, call, control_sockets

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


async def test_each_api_worker_has_its_own_socket_and_a_drain_finds_them_all(tmp_path: Path):
    base = tmp_path / "api.sock"
    assert control_sockets(str(base), 8000) == [base]  # none yet: the one process's, for the error to name
    paths = [admin_socket_path(str(base), 8000, worker) for worker in (0, 1)]
    assert [p.name for p in paths] == ["api-0.sock", "api-1.sock"]
    assert admin_socket_path("", 8000, 1) == admin_socket_path("", 8000).with_name("control-1.sock")
    sockets = [AdminSocket(_service(), p, 60.0) for p in paths]
    for s in sockets:
        await s.start()
    (tmp_path / "api-x.sock").touch()  # not a socket: nobody to drain
    assert control_sockets(str(base), 8000) == paths
    for s in sockets:
        await s.close()
