"""`rsinfer up`: an embedded redis-server, one tokenizer, scheduler and detokenizer, and the API, each its
own process talking only through Redis; stopped on Ctrl-C/SIGTERM in the order a rollout stops them: the API
drains, then the stages, then Redis."""

from __future__ import annotations

import base64
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

from pydantic_settings import BaseSettings

from rsinfer import local
from rsinfer.command_settings import UpSettings
from rsinfer.launcher import SINGLE_THREAD, Launcher, ProcessDied, serving
from rsinfer.logs import setup_logging
from rsinfer.redis_server import RedisServer
from services.api.multitenancy.tenants import KeyFileError, check_keys
from shared.models import resolve_model
from shared.settings import (
    ApiSettings,
    DetokenizerSettings,
    SchedulerSettings,
    TokenizerSettings,
)

log = logging.getLogger("rsinfer.up")

ROLES: dict[str, type[BaseSettings]] = {"tokenizer": TokenizerSettings, "scheduler": SchedulerSettings,
                                        "detokenizer": DetokenizerSettings, "api": ApiSettings}


def child_env(settings: UpSettings, cls: type[BaseSettings]) -> dict[str, str]:
    """The variables that give a child the settings `up` was given (flags or RSINFER_* variables) for every
    field the child knows; the rest keep the child's own defaults (or this process's RSINFER_* variables)."""
    env = {}
    for name in settings.model_fields_set & set(cls.model_fields):
        value = getattr(settings, name)
        if value is not None:
            env[f"RSINFER_{name.upper()}"] = str(value).lower() if isinstance(value, bool) else str(value)
    return env


class Up:
    """One `rsinfer up`: its port claimed (rsinfer/local.py) before anything starts, its runtime directory (the
    embedded Redis's files, the stages' liveness files), its children and their stop.

    SIGINT (Ctrl-C) and SIGTERM: the first stops the stack in order, a second cuts every drain short (the
    children end their streams and hand their work back at once)."""

    def __init__(self, settings: UpSettings) -> None:
        self.settings = settings
        # Each child leads a process group of its own, so a terminal's Ctrl-C reaches `up` alone, which stops them
        # in order; they still die with `up` (rsinfer/children.py).
        self.stack = Launcher(own_groups=True)
        self.signals = 0
        self.runtime = Path(tempfile.mkdtemp(prefix=f"{local.RUNTIME_PREFIX}{settings.port}-"))
        self.state: Path | None = None
        self.redis: RedisServer | None = None
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, *_: object) -> None:
        self.signals += 1
        if self.signals == 2:
            print("rsinfer: stopping at once", flush=True)
            for name, proc in list(self.stack.procs.items()):
                if proc.poll() is None:
                    self.stack.send_signal(name, signal.SIGTERM)

    def run(self) -> int:
        try:
            self.state = local.claim(self.settings.port, self.runtime)  # nothing else of this port's starts
            port_free(self.settings.host, self.settings.port)
            self.redis = None if self.settings.redis_url else embedded_redis(self.settings, self.runtime / "redis")
            if not self.start():
                return 0
            failed = self.wait_serving()
            return self.watch() if failed is None else failed
        except (local.StackError, OSError) as e:
            print(f"rsinfer: {e}", flush=True)
            return 1
        finally:
            self.stop()

    def start(self) -> bool:
        """Start the children (False if a signal came first)."""
        settings = self.settings
        redis_url = settings.redis_url or self.redis.url
        model_path, self.model = resolve_model(settings)
        common: dict[str, str | None] = {
            "RSINFER_REDIS_URL": redis_url, "RSINFER_MODEL": model_path, "RSINFER_SERVED_MODEL_NAME": self.model,
            "RSINFER_HOST": settings.host,
            "RSINFER_MODELS": ",".join(dict.fromkeys([*settings.model_names(), self.model]))}
        if self.redis is not None:  # its password from the file: in neither argv nor the environment
            common.update(RSINFER_REDIS_PASSWORD=None, RSINFER_REDIS_PASSWORD_FILE=str(password_file(self.redis)))
        if not (settings.responses_key or settings.responses_key_file):  # one key for every API worker of this up
            common["RSINFER_RESPONSES_KEY_FILE"] = str(responses_key_file(self.runtime))
        # each stage's liveness file is this stack's, so `rsinfer healthcheck` next to it reports this stack
        liveness = {role: str(self.runtime / f"{role}.alive") for role in ROLES if role != "api"}
        # where `rsinfer inspect`, `healthcheck` and `drain` find this stack without flags (rsinfer/local.py)
        local.update(self.state, namespace=settings.namespace, liveness=liveness, **(
            {"redis_url": redis_url, "redis_password_file": str(password_file(self.redis))} if self.redis else {}))
        for role, cls in ROLES.items():
            if self.signals:
                return False
            own = {"RSINFER_LIVENESS_FILE": liveness[role]} if role in liveness else {}
            self.stack.start(role, role, **{**child_env(settings, cls), **common, **own,
                                            **({} if role == "scheduler" else SINGLE_THREAD)})
        print(f"rsinfer: redis at {redis_url} ({redis_cli_hint(self.redis, redis_url)}), "
              f"namespace '{settings.namespace}'", flush=True)
        print(f"rsinfer: serving model '{self.model}' from {model_path}", flush=True)
        if settings.host not in ("127.0.0.1", "::1", "localhost") and not key_required(settings):
            print(f"rsinfer: warning: listening on {settings.host} with no API key: anyone who can reach this "
                  "machine can use it (RSINFER_API_KEY or --api-key-file)", flush=True)
        return True

    def wait_serving(self) -> int | None:
        """Until this stack's own API (not another server on the port) serves the model: None, else the exit
        status (0 when a signal came first, 1 when a child died or time ran out)."""
        settings = self.settings
        host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
        url, pid = f"http://{host}:{settings.port}", self.stack.procs["api"].pid
        try:
            self.stack.wait_until(lambda: self.signals or serving(url, self.model, pid=pid), 300.0,
                                  url)
        except (ProcessDied, TimeoutError):
            print(f"rsinfer: failed to start: {', '.join(self.stack.dead()) or 'not ready in time'}", flush=True)
            return 1
        if self.signals:
            return 0
        if key := key_required(settings):
            print(f"rsinfer: clients must send an API key (Authorization: Bearer <key>): {key}", flush=True)
        print(f"rsinfer: ready on {url}  (OpenAI base URL {url}/v1)", flush=True)
        return None

    def watch(self) -> int:
        """Until a signal (0) or a child's death (1)."""
        while not self.signals:
            if self.stack.dead():
                print(f"rsinfer: a process died: {', '.join(self.stack.dead())}; stopping", flush=True)
                return 1
            time.sleep(0.5)
        print("rsinfer: stopping: the API drains its open streams, then the workers stop, then Redis "
              "(Ctrl-C again to stop at once)", flush=True)
        return 0

    def stop(self) -> None:
        """As a rollout does (the chart's preStop, then SIGTERM): the API drains first (new requests 503, open
        streams finish within --grace-period-s), then the stages, which finish what is left, then Redis; then
        this stack's files."""
        margin = 10.0  # past the grace period: the API's own shutdown, a stage's hand-back
        self.stack.stop(self.settings.grace_period_s + margin, names=["api"])
        self.stack.stop(self.settings.grace_period_s + margin)
        if self.redis is not None:
            self.redis.stop()
        if self.state is not None:
            local.forget(self.state)
        shutil.rmtree(self.runtime, ignore_errors=True)


def run_up(settings: UpSettings) -> int:
    """The keys are checked before anything starts (one line naming the entry and field, not an API process
    that dies with a traceback), then the stack runs."""
    try:
        check_keys(settings.api_keys_file, settings.api_key)
    except KeyFileError as e:
        print(f"rsinfer: not started: {e}", file=sys.stderr, flush=True)
        return 2
    setup_logging(settings.log_level, "up", str(os.getpid()))
    return Up(settings).run()


def port_free(host: str, port: int) -> None:
    """OSError unless the API could listen on host:port now (bound as uvicorn binds: SO_REUSEADDR)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise OSError(f"cannot listen on {host}:{port}: {e.strerror} (another server holds it? give another "
                          "--port)") from None


def key_required(settings: UpSettings) -> str | None:
    """Where the API key clients must send comes from, when the API requires one."""
    if settings.api_keys_file:
        return f"one of the keys in {settings.api_keys_file} (--api-keys-file)"
    if settings.api_key_file:
        return f"the key in {settings.api_key_file} (--api-key-file)"
    if settings.api_key:
        given = "RSINFER_API_KEY" if os.environ.get("RSINFER_API_KEY") == settings.api_key else "--api-key"
        return f"the key in {given}"
    return None


def embedded_redis(settings: UpSettings, workdir: Path) -> RedisServer:
    """A redis-server for this `up`: bounded by --redis-maxmemory (noeviction), with a password (yours, or a random
    one) written to a 0600 file in its 0700 directory `workdir` for the children and operators."""
    password = settings.redis_password or secrets.token_urlsafe(24)
    server = RedisServer(settings.redis_port, maxmemory=settings.redis_maxmemory, password=password, workdir=workdir)
    fd = os.open(password_file(server), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(password + "\n")
    return server.start()


def responses_key_file(runtime: Path) -> Path:
    """A random key sealing reasoning items (--responses-key-file) in a 0600 file of this up's 0700 directory:
    its API processes, and its restarted workers, open each other's `encrypted_content`."""
    path = runtime / "responses-key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(base64.b64encode(secrets.token_bytes(32)).decode() + "\n")
    return path


def password_file(server: RedisServer) -> Path:
    return Path(server.dir) / "password"


def redis_cli_hint(server: RedisServer | None, url: str) -> str:
    if server is None:
        return f"redis-cli -u {url}"
    path = password_file(server)
    return f'password in {path}: REDISCLI_AUTH="$(cat {path})" redis-cli -u {url}'

