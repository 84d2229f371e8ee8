"""--listen-backlog reaches the API's listening socket, and a backlog over the kernel's cap is warned about
(a burst of connections past the accept queue is reset: docs/operator-guide.md, "Connection storms")."""

from __future__ import annotations

import asyncio
import logging
import shutil
import subprocess

import pytest
import uvicorn

from rsinfer.redis_server import free_port
from services.api.main import server_config, warn_backlog_capped
from shared.settings import ApiSettings


async def _app(scope, receive, send) -> None:  # uvicorn's lifespan events only: nothing connects
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to read a listening socket's backlog")
def test_listen_backlog_is_the_sockets():
    port = free_port()
    config = server_config(_app, ApiSettings(host="127.0.0.1", port=port, listen_backlog=1234))
    config.load()
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)  # what Server.serve sets up before startup()

    async def listening_backlog() -> str:
        await server.startup()
        try:
            out = (await asyncio.to_thread(subprocess.run, ["ss", "-ltnH", f"( sport = :{port} )"],
                                           capture_output=True, text=True, check=True)).stdout
        finally:
            await server.shutdown()
        return out.split()[2]  # State Recv-Q Send-Q: a listening socket's Send-Q is its backlog

    assert asyncio.run(listening_backlog()) == str(min(1234, _somaxconn()))


def _somaxconn() -> int:
    try:
        with open("/proc/sys/net/core/somaxconn") as f:
            return int(f.read())
    except OSError:
        return 1 << 30


def test_backlog_over_somaxconn_is_warned(tmp_path, caplog):
    cap = tmp_path / "somaxconn"
    cap.write_text("4096\n")
    with caplog.at_level(logging.WARNING, logger="services.api.main"):
        assert warn_backlog_capped(4096, cap) == 4096
        assert not caplog.records
        assert warn_backlog_capped(8192, cap) == 4096
    assert "--listen-backlog 8192 is over net.core.somaxconn 4096" in caplog.text
    assert warn_backlog_capped(8192, tmp_path / "absent") is None
