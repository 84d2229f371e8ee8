"""Fair queueing between tenants, the pure part: which held job goes to the schedulers next, and how many may go.

With --fair-queueing the tokenizer does not forward a tokenized job at once: it holds it (its tokenize entry
stays pending in the tokenizer group, kept alive, so a peer claims it if this process dies) and releases held
jobs to the schedule stream only while that stream's backlog (entries no scheduler has taken yet) is below
--fair-watermark. The backlog then builds here, where it can be ordered, instead of in the schedule stream,
which the schedulers read first come first served: each tenant has a lane (first in, first out), and the
lanes take turns, a turn releasing as many of its tenant's jobs as its weight (the key's `weight`, 1 by
default). A tenant that sends its first job while another's flood is held waits for one turn of each tenant
ahead of it, not for the whole flood (docs/design.md, "Fair queueing").
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


def releasable(backlog: int, watermark: int, held: int) -> int:
    """How many held jobs to release now: enough to bring the schedule stream's backlog up to the watermark."""
    return max(0, min(held, watermark - backlog))


class FairQueue(Generic[T]):
    """Lanes of items per tenant, served in weighted turns (module doc). A lane is dropped once empty, and a
    tenant whose lane is new joins at the end of the round."""

    def __init__(self) -> None:
        self._lanes: OrderedDict[str, deque[T]] = OrderedDict()  # the round, in turn order: the head's turn now
        self._weights: dict[str, int] = {}
        self._left = 0  # items the head lane may still release in its turn

    def __len__(self) -> int:
        return sum(len(lane) for lane in self._lanes.values())

    def push(self, tenant: str, weight: int, item: T) -> None:
        """Queue `item` at the end of its tenant's lane (the job's latest weight is the lane's)."""
        self._lanes.setdefault(tenant, deque()).append(item)
        self._weights[tenant] = max(1, weight)

    def restore(self, tenant: str, weight: int, item: T) -> None:
        """Put an item taken back at the head of its tenant's lane (its release failed)."""
        self._lanes.setdefault(tenant, deque()).appendleft(item)
        self._weights[tenant] = max(1, weight)

    def pop(self) -> T | None:
        """The next item in turn, or None when nothing is held."""
        if not self._lanes:
            return None
        tenant, lane = next(iter(self._lanes.items()))
        if self._left <= 0:
            self._left = self._weights[tenant]
        item = lane.popleft()
        self._left -= 1
        if not lane:
            self._drop(tenant)
        elif self._left == 0:
            self._lanes.move_to_end(tenant)
        return item

    def take(self, n: int) -> list[T]:
        """Up to `n` items, in turn."""
        out: list[T] = []
        while len(out) < n and (item := self.pop()) is not None:
            out.append(item)
        return out

    def remove(self, unwanted: Callable[[T], bool]) -> list[T]:
        """Take out the items `unwanted` says (a peer claimed them), keeping every lane's order and turn."""
        gone: list[T] = []
        for tenant, lane in list(self._lanes.items()):
            keep = deque(i for i in lane if not unwanted(i))
            gone += [i for i in lane if unwanted(i)]
            if keep:
                self._lanes[tenant] = keep
            else:
                self._drop(tenant)
        return gone

    def items(self) -> list[T]:
        return [i for lane in self._lanes.values() for i in lane]

    def tenants(self) -> dict[str, int]:
        """Items held per tenant."""
        return {t: len(lane) for t, lane in self._lanes.items()}

    def _drop(self, tenant: str) -> None:
        head = next(iter(self._lanes)) == tenant
        del self._lanes[tenant], self._weights[tenant]
        if head:
            self._left = 0
