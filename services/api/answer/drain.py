"""Whether this API process is out of service (`Drain.draining`): shut down for good (SIGTERM,
services/api/main.py) or drained for a while over the control socket (services/api/edge/admin.py). Admission
refuses new requests while it is (services/api/answer/admission.py `room`), `/ready` says so, and the batch runner
takes no new batch."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Drain:
    def __init__(self, inflight: Callable[[], int]):
        self.inflight = inflight  # how many requests this process follows, for the log
        self._shutting_down = False  # SIGTERM (services/api/main.py): out of service for good
        self._drained_until = 0.0  # a drain over the control socket (services/api/edge/admin.py), until then

    @property
    def draining(self) -> bool:
        """Out of service: `/ready` 503 and new requests 503 (open streams go on)."""
        return self._shutting_down or time.monotonic() < self._drained_until

    @draining.setter
    def draining(self, value: bool) -> None:
        self._shutting_down = value

    def drain_for(self, seconds: float) -> None:
        """Out of service for `seconds` (the preStop hook; SIGTERM normally follows within them), then back in
        service unless shutting down: a drain nobody followed up must not keep the pod unready for ever."""
        first = not self.draining
        self._drained_until = time.monotonic() + seconds
        log.info("drained for %.0fs (%d requests in flight)", seconds, self.inflight())
        if first:
            asyncio.get_running_loop().call_later(seconds + 0.05, self._drain_expired)

    def _drain_expired(self) -> None:
        if self._shutting_down:
            return
        if self.draining:  # drained again since: its own timer comes later
            asyncio.get_running_loop().call_later(self._drained_until - time.monotonic() + 0.05,
                                                  self._drain_expired)
            return
        log.warning("drain not followed by SIGTERM within its timeout: back in service")
