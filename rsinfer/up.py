"""`rsinfer up`: an embedded redis-server, one tokenizer, scheduler and detokenizer, and the API, each its
own process talking only through Redis; stopped together on Ctrl-C/SIGTERM, in reverse order."""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pydantic_settings import BaseSettings

from shared import children
from shared.logs import setup_logging
from shared.models import resolve_model
from shared.redis_server import RedisServer
from shared.settings import (
    ApiSettings,
    DetokenizerSettings,
    SchedulerSettings,
    TokenizerSettings,
    UpSettings,
)

log = logging.getLogger("rsinfer.up")

ROLES: dict[str, type[BaseSettings]] = {"tokenizer": TokenizerSettings, "scheduler": SchedulerSettings,
                                        "detokenizer": DetokenizerSettings, "api": ApiSettings}


def child_env(settings: UpSettings, cls: type[BaseSettings], overrides: dict[str, str]) -> dict[str, str]:
    """The environment that gives a child the settings `up` was given (flags or RSINFER_* variables)
    for every field the child knows; the rest keep the child's own defaults."""
    env = dict(os.environ)
    for name in settings.model_fields_set & set(cls.model_fields):
        value = getattr(settings, name)
        if value is not None:
            env[f"RSINFER_{name.upper()}"] = str(value).lower() if isinstance(value, bool) else str(value)
    env.update(overrides)
    return env


class Stack:
    """Child processes of one `up`, started in pipeline order and stopped in reverse."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def spawn(self, role: str, env: dict[str, str]) -> subprocess.Popen:
        proc = children.spawn([sys.executable, "-m", "rsinfer.cli", role], env=env)
        self.procs.append((role, proc))
        return proc

    def dead(self) -> list[str]:
        return [f"{role} (exit {p.returncode})" for role, p in self.procs if p.poll() is not None]

    def stop(self, grace: float = 10.0) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for _, proc in reversed(self.procs):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def serving(url: str, model: str | None = None, api_key: str | None = None) -> bool:
    """The API at `url` is ready and `model` (or every model it knows, at least one) has a live worker in
    every stage. `/ready` alone says only that the API takes requests: they would wait for the workers.
    `api_key`: the key the API requires (for /v1/models; /ready is open)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=2) as resp:
            if resp.status != 200:
                return False
        with urllib.request.urlopen(urllib.request.Request(f"{url}/v1/models", headers=headers), timeout=2) as resp:
            cards = json.loads(resp.read())["data"]
    except (OSError, ValueError, KeyError):
        return False
    states = {c.get("id"): c.get("state") for c in cards}
    wanted = [model] if model else list(states)
    return bool(wanted) and all(states.get(m) == "ready" for m in wanted)


def wait_ready(url: str, stack: Stack, model: str, api_key: str | None, timeout: float = 300.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if stack.dead():
            return False
        if serving(url, model, api_key):
            return True
        time.sleep(0.3)
    return False


def run_up(settings: UpSettings) -> int:
    setup_logging(settings.log_level, "up", str(os.getpid()))
    stopping = False

    def on_signal(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    redis_server = None if settings.redis_url else embedded_redis(settings)
    redis_url = settings.redis_url or redis_server.url
    stack = Stack()
    try:
        model_path, model_name = resolve_model(settings)
        common = {"RSINFER_REDIS_URL": redis_url, "RSINFER_MODEL": model_path,
                  "RSINFER_SERVED_MODEL_NAME": model_name, "RSINFER_HOST": settings.host,
                  "RSINFER_MODELS": ",".join(dict.fromkeys([*settings.model_names(), model_name]))}
        single = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        for role, cls in ROLES.items():
            env = child_env(settings, cls, {**common, **({} if role == "scheduler" else single)})
            if redis_server is not None:  # its password from the file: in neither argv nor the environment
                env.pop("RSINFER_REDIS_PASSWORD", None)
                env["RSINFER_REDIS_PASSWORD_FILE"] = str(password_file(redis_server))
            stack.spawn(role, env)
        host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
        api_url = f"http://{host}:{settings.port}"
        print(f"rsinfer: redis at {redis_url} ({redis_cli_hint(redis_server, redis_url)}), "
              f"namespace '{settings.namespace}'", flush=True)
        print(f"rsinfer: serving model '{model_name}' from {model_path}", flush=True)
        if settings.host not in ("127.0.0.1", "::1", "localhost") and not settings.api_key:
            print(f"rsinfer: warning: listening on {settings.host} with no API key: anyone who can reach this "
                  "machine can use it (RSINFER_API_KEY or --api-key-file)", flush=True)
        if not wait_ready(api_url, stack, model_name, settings.api_key):
            print(f"rsinfer: failed to start: {', '.join(stack.dead()) or 'not ready in time'}", flush=True)
            return 1
        print(f"rsinfer: ready on {api_url}  (OpenAI base URL {api_url}/v1)", flush=True)
        while not stopping:
            if stack.dead():
                print(f"rsinfer: a process died: {', '.join(stack.dead())}; stopping", flush=True)
                return 1
            time.sleep(0.5)
        return 0
    finally:
        stack.stop(settings.grace_period_s)
        if redis_server:
            redis_server.stop()


def embedded_redis(settings: UpSettings) -> RedisServer:
    """A redis-server for this `up`: bounded by --redis-maxmemory (noeviction), with a password (yours, or a random
    one) written to a 0600 file in its 0700 directory for the children and operators."""
    password = settings.redis_password or secrets.token_urlsafe(24)
    server = RedisServer(settings.redis_port, maxmemory=settings.redis_maxmemory, password=password)
    fd = os.open(password_file(server), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(password + "\n")
    return server.start()


def password_file(server: RedisServer) -> Path:
    return Path(server.dir) / "password"


def redis_cli_hint(server: RedisServer | None, url: str) -> str:
    if server is None:
        return f"redis-cli -u {url}"
    path = password_file(server)
    return f'password in {path}: REDISCLI_AUTH="$(cat {path})" redis-cli -u {url}'

