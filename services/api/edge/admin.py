"""The API process's control socket: a UNIX socket that only processes of its own pod (container) can open, for
the preStop hook (`rsinfer drain`). Nothing of it is reachable over HTTP: not by a client with the API key, not
by a reverse proxy on the same host (every caller of which is loopback), not by a browser's cross-site request.

It lives in a directory of its own (mode 0700, owned by this user) in the temp directory (a pod's /tmp
emptyDir, which the hook's exec shares), named after the HTTP port unless `--admin-socket` names it. One line of
JSON in, one line out:

    {"op": "drain"}  ->  {"draining": true, "inflight": 3, "for_s": 40.0}

A drain takes the process out of service (`/ready` 503, new requests 503) for `--drain-timeout-s`; SIGTERM
normally follows within it (Kubernetes sends it when the hook returns) and drains for good. A drain not followed
by SIGTERM within that time is undone: the pod goes back in service rather than sitting unready for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import stat
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.api.answer.collaborators import ApiContext

log = logging.getLogger(__name__)

MAX_LINE = 4096


def admin_socket_path(explicit: str, port: int, worker: int | None = None) -> Path:
    """The control socket of the API process on `port`; of its worker `worker` where `--api-workers` runs several
    (`control-<worker>.sock`, beside where the one process's would be)."""
    path = Path(explicit) if explicit else Path(tempfile.gettempdir()) / f"rsinfer-api-{port}" / "control.sock"
    return path if worker is None else path.with_name(f"{path.stem}-{worker}{path.suffix}")


def control_sockets(explicit: str, port: int) -> list[Path]:
    """Every control socket of the API on `port` there is (its one process's, or each of its workers'); the one
    process's path when there is none, for the error to name."""
    path = admin_socket_path(explicit, port)
    # a socket file nobody answers on is a killed process's, left on a port reused since: not this API's
    found = [p for p in [path, *sorted(path.parent.glob(f"{path.stem}-*{path.suffix}"))]
             if p.is_socket() and _answers(p)]
    return found or [path]


def _private_dir(path: Path) -> None:
    """The socket's directory, 0700 and ours: whoever can enter it can drain the pod."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise PermissionError(f"{path} must be a directory of uid {os.getuid()} with mode 0700 (it holds the API's "
                              "control socket)")


def _answers(path: Path) -> bool:
    """A process listens on the socket at `path`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


class AdminSocket:
    """The socket, and what it leaves: a process removes only its own socket (never that of another API process
    on the port, whose start failed), and the directory it made, when empty."""

    def __init__(self, ctx: ApiContext, path: Path, drain_timeout_s: float, own_dir: bool = False):
        self.ctx, self.path, self.drain_timeout_s, self.own_dir = ctx, path, drain_timeout_s, own_dir
        self.server: asyncio.AbstractServer | None = None
        self.inode: int | None = None  # of the socket file this process bound

    async def start(self) -> None:
        _private_dir(self.path.parent)
        if self.path.exists():
            if _answers(self.path):
                raise RuntimeError(f"another API process serves the control socket {self.path} (its port is "
                                   "taken: give another --port, or --admin-socket)")
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()  # a crashed predecessor's
        self.server = await asyncio.start_unix_server(self._serve, path=str(self.path), limit=MAX_LINE)
        os.chmod(self.path, 0o600)
        self.inode = self.path.stat().st_ino
        log.info("control socket at %s", self.path)

    async def close(self) -> None:
        if self.server is None:
            return
        self.server.close()
        with contextlib.suppress(Exception):
            await self.server.wait_closed()
        with contextlib.suppress(OSError):
            if self.path.stat().st_ino == self.inode:
                self.path.unlink()
        if self.own_dir:
            with contextlib.suppress(OSError):  # not empty: another process's socket, or someone's files
                self.path.parent.rmdir()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 5)
            request = json.loads(line or b"{}")
            op = request.get("op") if isinstance(request, dict) else None
            if op == "drain":
                self.ctx.drain.drain_for(self.drain_timeout_s)
                reply = {"draining": True, "inflight": len(self.ctx.requests.inflight), "for_s": self.drain_timeout_s}
            else:
                reply = {"error": f"unknown op {op!r}; known: drain"}
        except (ValueError, TimeoutError, asyncio.LimitOverrunError) as e:
            reply = {"error": f"bad request: {e}"}
        with contextlib.suppress(OSError):
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
            writer.close()


def call(path: Path, op: str, timeout: float = 10.0) -> dict:
    """One request to the control socket at `path` (blocking: the CLI's side)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        s.sendall(json.dumps({"op": op}).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(MAX_LINE)
            if not chunk:
                break
            data += chunk
    return json.loads(data)
