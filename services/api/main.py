"""`rsinfer api`: the HTTP API process, with a graceful drain on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
from pathlib import Path

import uvicorn

from services.api.edge.app import create_app
from services.api.edge.http import edge_protocol
from services.api.multitenancy.tenants import KeyFileError, check_keys
from shared.settings import ApiSettings

log = logging.getLogger(__name__)

SOMAXCONN = Path("/proc/sys/net/core/somaxconn")


class DrainingServer(uvicorn.Server):
    """On the first SIGTERM/SIGINT: stop taking requests (503, /ready false), let open streams finish
    within the grace period, then stop. A second signal stops at once."""

    def __init__(self, config: uvicorn.Config, settings: ApiSettings, service):
        super().__init__(config)
        self.settings, self.service = settings, service
        self.draining = False

    def handle_exit(self, sig, frame) -> None:
        if self.draining or not self.started:
            self._end_streams()
            return super().handle_exit(sig, frame)
        self.draining = True
        asyncio.get_event_loop().call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        svc = self.service
        svc.draining = True
        log.info("draining: %d requests in flight, up to %.0fs", len(svc.requests.inflight),
                 self.settings.grace_period_s)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.settings.grace_period_s):
                await svc.requests.drained()
        self._end_streams()  # streams still open end (their requests are aborted unless in the background)
        self.should_exit = True

    def _end_streams(self) -> None:
        with contextlib.suppress(RuntimeError):  # no loop yet: nothing is streaming
            asyncio.get_event_loop().call_soon_threadsafe(self.service.closing.set)


def run(settings: ApiSettings, sockets: list[socket.socket] | None = None, worker: int | None = None) -> int:
    """Serve until stopped; 3 when it did not start (its app's startup failed). `sockets` and `worker`: one of
    the processes of `--api-workers` (rsinfer/api_workers.py), on the listening socket its supervisor bound."""
    # Long keep-alive by default (--keep-alive-s 120): load generators and proxies reuse connections; 5 s broke
    # reused ones (docs/design.md, "Measured facts behind the design"). The head's deadline and size and the
    # connection limit are the protocol's (services/api/edge/http.py).
    try:  # before anything starts: one line naming the entry and field, not a traceback
        check_keys(settings.api_keys_file, settings.api_key)
    except KeyFileError as e:
        print(f"rsinfer api: not started: {e}", file=sys.stderr, flush=True)
        return 2
    app = create_app(settings, worker)
    server = DrainingServer(server_config(app, settings), settings, app.service)
    server.run(sockets=sockets)
    return 0 if server.started else 3


def server_config(app, settings: ApiSettings) -> uvicorn.Config:
    """uvicorn's configuration of this process: the edge protocol, keep-alive and the listening socket's backlog."""
    warn_backlog_capped(settings.listen_backlog)
    return uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning",
                          http=edge_protocol(settings), timeout_keep_alive=settings.keep_alive_s,
                          timeout_graceful_shutdown=5, backlog=settings.listen_backlog)


def warn_backlog_capped(asked: int, somaxconn: Path = SOMAXCONN) -> int | None:
    """Log a warning when `asked` is over the kernel's cap on a listening socket's backlog (Linux lowers it
    silently, and a burst of connections past the lower one is reset); the cap, where the kernel says it."""
    try:
        cap = int(somaxconn.read_text())
    except (OSError, ValueError):
        return None  # not Linux, or no /proc: nothing to compare with
    if asked > cap:
        log.warning("--listen-backlog %d is over net.core.somaxconn %d: the kernel holds only %d connections "
                    "waiting to be accepted (raise net.core.somaxconn, docs/operator-guide.md)", asked, cap, cap)
    return cap
