"""When a dead API worker process (rsinfer/api_workers.py) starts again, and when its group gives up: pure
decisions on the times of deaths, so that they are tested without processes.

A worker that died is started again after a backoff that doubles with each death of the group within the window
(0.5 s, 1 s, 2 s...). More than `max_deaths` deaths within `window_s`, every worker together, is a crash loop (a
configuration every worker dies of, say): the group stops and exits nonzero, so that Kubernetes sees the pod's
container fail and restarts it with its own backoff (CrashLoopBackOff) rather than this process hiding it."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class RestartPolicy:
    max_deaths: int = 3
    window_s: float = 60.0
    first_delay_s: float = 0.5
    max_delay_s: float = 10.0
    deaths: deque[float] = field(default_factory=deque)  # when workers died, within the window

    def on_death(self, now: float) -> float | None:
        """A worker died at `now` (a monotonic clock's seconds): seconds until it starts again, or None when the
        group must stop (a crash loop)."""
        self.deaths.append(now)
        while now - self.deaths[0] > self.window_s:
            self.deaths.popleft()
        if len(self.deaths) > self.max_deaths:
            return None
        return min(self.max_delay_s, self.first_delay_s * 2 ** (len(self.deaths) - 1))
