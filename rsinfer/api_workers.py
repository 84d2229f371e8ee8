"""`rsinfer api --api-workers N`: N API processes on one port, so that one pod uses all its cores. This process
(the supervisor) binds one listening socket per worker on the port (SO_REUSEPORT: the kernel spreads connections
over them) and starts each worker as a fresh interpreter (`python -m rsinfer.api_workers`, its settings on a
pipe); it imports nothing of the app. Each worker is today's API process (services/api/main.py) on the socket
it is given: its own identity (<name>@<pid>...), hence its own reply hub, inbox and leases; its own control
socket (control-<i>.sock, which `rsinfer drain` finds); its metrics shared through PROMETHEUS_MULTIPROC_DIR
(services/api/operations/metrics.py).

A worker that dies is started again on the same socket (connections the kernel gave it meanwhile wait in its
backlog rather than being reset), after the backoff of rsinfer/supervision.py; a crash loop stops the group
with exit status 1. SIGTERM or SIGINT is forwarded to every worker as SIGTERM (each drains as one API process
does); the supervisor exits once they all have. A second signal is forwarded too: the workers stop at once.
Should the supervisor die, even by SIGKILL, the kernel sends each worker SIGTERM (rsinfer/children.py)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from prometheus_client.multiprocess import mark_process_dead

from rsinfer.children import spawn
from rsinfer.supervision import RestartPolicy
from shared.settings import ApiSettings

log = logging.getLogger("rsinfer.api_workers")

POLL_S = 0.2
SECRETS = ("redis_password", "api_key")  # read from their files by each worker itself, when given as files


def listening_sockets(host: str, port: int, count: int, backlog: int) -> list[socket.socket]:
    """`count` sockets listening on host:port together (port 0: the first one's free port)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE)[0]
            s = socket.socket(family, kind, proto)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind(addr)
            s.listen(backlog)
            port = s.getsockname()[1]
    except OSError:
        for s in socks:
            s.close()
        raise
    return socks


def worker_spec(settings: ApiSettings, index: int, sock: socket.socket) -> bytes:
    """What a worker reads on its stdin: its index, its socket's descriptor and the group's settings (a secret
    given in a file left for the worker to read: in neither argv nor the environment)."""
    skip = {name for name in SECRETS if getattr(settings, f"{name}_file")}
    return json.dumps({"worker": index, "fd": sock.fileno(), "settings": json.loads(
        settings.model_dump_json(exclude=skip))}).encode() + b"\n"


class WorkerGroup:
    """The workers, their restarts and their stop."""

    def __init__(self, settings: ApiSettings, socks: list[socket.socket], metrics_dir: str):
        self.settings, self.socks, self.metrics_dir = settings, socks, metrics_dir
        self.env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
        self.procs: dict[int, subprocess.Popen] = {}
        self.due: dict[int, float] = {}  # worker -> when it starts again
        self.policy = RestartPolicy()
        self.signals = self.forwarded = 0  # the handler only counts; the loop forwards (no race with a start)

    def on_signal(self, *_: object) -> None:
        self.signals += 1

    def start(self, index: int) -> None:
        sock = self.socks[index]
        # A session of its own: a signal to our process group (a terminal's Ctrl-C, `rsinfer up` stopping us)
        # reaches it once, forwarded, not twice (a second signal cuts a drain short).
        proc = spawn([sys.executable, "-m", "rsinfer.api_workers"], stdin=subprocess.PIPE, env=self.env,
                     pass_fds=[sock.fileno()], start_new_session=True)
        proc.stdin.write(worker_spec(self.settings, index, sock))
        proc.stdin.close()
        self.procs[index] = proc
        log.info("api worker %d started: pid %d", index, proc.pid)

    def stop(self) -> None:
        """Each signal not yet passed on, to every live worker as SIGTERM; no restart once stopping."""
        if self.signals:
            self.due.clear()
        while self.forwarded < self.signals:
            self.forwarded += 1
            for proc in self.procs.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)

    def run(self) -> int:
        """Until every worker stopped after a signal (0) or the workers crash-loop (1, once the rest stopped)."""
        for index in range(len(self.socks)):
            self.start(index)
        crashed = False
        while self.procs or not (self.signals or crashed):
            self.stop()
            for index, proc in list(self.procs.items()):
                if proc.poll() is not None and not self.died(index, proc):
                    crashed = True
                    self.signals = max(self.signals, 1)
            now = time.monotonic()
            for index, at in list(self.due.items()):
                if at <= now and not self.signals:
                    del self.due[index]
                    self.start(index)
            time.sleep(POLL_S)
        return 1 if crashed else 0

    def died(self, index: int, proc: subprocess.Popen) -> bool:
        """A worker ended: its gauges go, and it starts again after a backoff; False: a crash loop."""
        del self.procs[index]
        mark_process_dead(proc.pid, self.metrics_dir)
        if self.signals:  # its socket goes too: new connections go to the workers still draining (a 503)
            self.socks[index].close()
            return True
        delay = self.policy.on_death(time.monotonic())
        if delay is None:
            log.error("api worker %d (pid %d) died with status %s: more than %d deaths within %.0f s: stopping "
                      "the group", index, proc.pid, proc.returncode, self.policy.max_deaths, self.policy.window_s)
            return False
        log.warning("api worker %d (pid %d) died with status %s: starting it again in %.1f s", index, proc.pid,
                    proc.returncode, delay)
        self.due[index] = time.monotonic() + delay
        return True


def run_workers(settings: ApiSettings) -> int:
    """The supervisor's life: the sockets, the workers, their end."""
    try:
        socks = listening_sockets(settings.host, settings.port, settings.api_workers, settings.listen_backlog)
    except OSError as e:
        print(f"rsinfer api: not started: cannot listen on {settings.host}:{settings.port}: {e}", file=sys.stderr,
              flush=True)
        return 1
    settings = settings.model_copy(update={"port": socks[0].getsockname()[1]})  # port 0: the one bound
    metrics_dir = tempfile.mkdtemp(prefix="rsinfer-api-metrics-")
    group = WorkerGroup(settings, socks, metrics_dir)
    signal.signal(signal.SIGTERM, group.on_signal)
    signal.signal(signal.SIGINT, group.on_signal)
    log.info("%d api workers on %s:%d", settings.api_workers, settings.host, settings.port)
    try:
        return group.run()
    finally:
        for s in socks:
            s.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)


def worker_main() -> int:
    """One worker (`python -m rsinfer.api_workers`): its spec from stdin, then the API on its socket."""
    from rsinfer.logs import setup_logging
    from services.api.main import run

    spec = json.loads(sys.stdin.readline())
    settings = ApiSettings(**spec["settings"])
    sock = socket.socket(fileno=spec["fd"])
    setup_logging(settings.log_level, f"api-{spec['worker']}", settings.identity())
    return run(settings, sockets=[sock], worker=spec["worker"])


if __name__ == "__main__":
    sys.exit(worker_main())
