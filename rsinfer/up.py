"""`rsinfer up`: an embedded redis-server, one tokenizer, scheduler and detokenizer, and the API, each its
own process talking only through Redis; stopped together on Ctrl-C/SIGTERM, in reverse order."""

from __future__ import annotations

import logging
import os
import secrets
import signal
import sys
import time
from pathlib import Path

from pydantic_settings import BaseSettings

from rsinfer import local
from rsinfer.launcher import SINGLE_THREAD, Launcher, ProcessDied
from services.api.tenants import KeyFileError, check_keys
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


def child_env(settings: UpSettings, cls: type[BaseSettings]) -> dict[str, str]:
    """The variables that give a child the settings `up` was given (flags or RSINFER_* variables) for every
    field the child knows; the rest keep the child's own defaults (or this process's RSINFER_* variables)."""
    env = {}
    for name in settings.model_fields_set & set(cls.model_fields):
        value = getattr(settings, name)
        if value is not None:
            env[f"RSINFER_{name.upper()}"] = str(value).lower() if isinstance(value, bool) else str(value)
    return env


def run_up(settings: UpSettings) -> int:
    """The keys are checked before anything starts (one line naming the entry and field, not an API process
    that dies with a traceback), then the stack runs."""
    try:
        check_keys(settings.api_keys_file, settings.api_key)
    except KeyFileError as e:
        print(f"rsinfer: not started: {e}", file=sys.stderr, flush=True)
        return 2
    return run_stack(settings)


def run_stack(settings: UpSettings) -> int:
    setup_logging(settings.log_level, "up", str(os.getpid()))
    stopping = False

    def on_signal(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    redis_server = None if settings.redis_url else embedded_redis(settings)
    redis_url = settings.redis_url or redis_server.url
    stack = Launcher()
    # where `rsinfer inspect` and `rsinfer healthcheck` find the embedded Redis without flags (rsinfer/local.py)
    left = local.remember(redis_url, str(password_file(redis_server)), settings.namespace) if redis_server else None
    try:
        model_path, model_name = resolve_model(settings)
        common: dict[str, str | None] = {
            "RSINFER_REDIS_URL": redis_url, "RSINFER_MODEL": model_path, "RSINFER_SERVED_MODEL_NAME": model_name,
            "RSINFER_HOST": settings.host,
            "RSINFER_MODELS": ",".join(dict.fromkeys([*settings.model_names(), model_name]))}
        if redis_server is not None:  # its password from the file: in neither argv nor the environment
            common.update(RSINFER_REDIS_PASSWORD=None, RSINFER_REDIS_PASSWORD_FILE=str(password_file(redis_server)))
        for role, cls in ROLES.items():
            stack.start(role, role, **{**child_env(settings, cls), **common,
                                       **({} if role == "scheduler" else SINGLE_THREAD)})
        host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
        api_url = f"http://{host}:{settings.port}"
        print(f"rsinfer: redis at {redis_url} ({redis_cli_hint(redis_server, redis_url)}), "
              f"namespace '{settings.namespace}'", flush=True)
        print(f"rsinfer: serving model '{model_name}' from {model_path}", flush=True)
        if settings.host not in ("127.0.0.1", "::1", "localhost") and not settings.api_key:
            print(f"rsinfer: warning: listening on {settings.host} with no API key: anyone who can reach this "
                  "machine can use it (RSINFER_API_KEY or --api-key-file)", flush=True)
        try:
            stack.wait_serving(api_url, model_name, 300.0, settings.api_key)
        except (ProcessDied, TimeoutError):
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
        if left is not None:
            local.forget(left)
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

