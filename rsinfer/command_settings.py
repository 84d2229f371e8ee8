"""The settings of the CLI's own commands (`rsinfer up`, `rsinfer healthcheck`, `rsinfer drain`): built from the
stages' settings (shared/settings.py), which every process shares, with what only these commands take. Their
fields are flags and `RSINFER_` variables as every other setting's (rsinfer/flags.py)."""

from __future__ import annotations

from pydantic import Field

from shared.settings import (
    ApiSettings,
    DrainSettings,
    LivenessSettings,
    RedisSettings,
    SchedulerSettings,
    TokenizerSettings,
    WorkerSettings,
)


class ProbeSettings(RedisSettings, WorkerSettings, LivenessSettings):
    """`rsinfer healthcheck`: finds a worker's liveness file and, with --ready, its heartbeat in Redis."""


class DrainCommand(DrainSettings):
    """`rsinfer drain`: finds the control socket of the pod's API process."""

    port: int = Field(8000, ge=0, le=65535, description="HTTP port of the API process to drain (its control "
                      "socket is named after it)")


class UpSettings(ApiSettings, SchedulerSettings, TokenizerSettings):
    """`rsinfer up`: everything on one machine. No --redis-url starts an embedded redis-server."""

    redis_url: str = Field("", description="Redis to use; empty = start an embedded redis-server")
    redis_port: int = Field(0, ge=0, le=65535, description="embedded redis-server port; 0 = a free one")
    # -- `rsinfer up`'s local defaults: loopback only, a bounded and password-protected embedded Redis --
    host: str = Field("127.0.0.1", description="address the API listens on (0.0.0.0: every interface; give an "
                      "API key then)")
    redis_maxmemory: str = Field("1gb", pattern=r"(?i)^[0-9]+(b|k|kb|m|mb|g|gb)?$",
                                 description="embedded redis-server's maxmemory (noeviction: past it writes are "
                                 "refused and the API answers 503 broker_full); 0 = unbounded")
