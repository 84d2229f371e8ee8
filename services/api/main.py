"""`rsinfer api`: the HTTP API process."""

from __future__ import annotations

import uvicorn

from services.api.app import create_app
from shared.settings import ApiSettings


def run(settings: ApiSettings) -> int:
    # Long keep-alive: load generators and proxies reuse connections; 5 s broke reused ones (notes).
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="warning",
                timeout_keep_alive=120, timeout_graceful_shutdown=int(settings.grace_period_s) or None)
    return 0
