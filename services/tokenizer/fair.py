"""Fair queueing between tenants, the pure part: which held job goes to the schedulers next, and how many may go.

With --fair-queueing the tokenizer does not forward a tokenized job at once: it holds it (its tokenize entry
stays pending in the tokenizer group, kept alive, so a peer claims it if this process dies) and releases held
jobs to the schedule stream only while that stream's backlog (entries no scheduler has taken yet) is below
--fair-watermark. The backlog then builds here, where it can be ordered, instead of in the schedule stream,
which the schedulers read first come first served: each tenant has a lane (first in, first out), and the
lanes take turns, a turn releasing as many of its tenant's jobs as its weight (the key's `weight`, 1 by
default). A tenant that sends its first job while another's flood is held waits for one turn of each tenant
ahead of it, not for the whole flood (docs/design.md, "Fair queueing"). Within a lane, a job with a time-to-first-token
target (an SLO: shared/messages.py RequestJob `ttft_due`) goes before every job of a later deadline or none, earliest
deadline first; jobs without one keep their order behind those, and a tenant's deadlines never pass another's turn.

The hold in memory is bounded (--fair-max-held); the tokenizer never stops reading because of it. Once it is full,
a tenant over its share of it (`holds`) has its jobs parked in Redis instead, in a stream of its own, and so does
a tenant that has jobs parked already (its jobs stay first in, first out); parked jobs are read back into their
tenant's lane as room frees, the emptiest lanes first (`refills`), so a tenant's turn never waits behind another's
excess, in memory or in Redis (services/tokenizer/holding.py).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


def releasable(backlog: int, watermark: int, held: int) -> int:
    """How many held jobs to release now: enough to bring the schedule stream's backlog up to the watermark."""
    return max(0, min(held, watermark - backlog))


def applies(setting: bool | None, tenant: str) -> bool:
    """Whether fair queueing takes a job: --fair-queueing on, or left unset (auto) and the job has a tenant (the
    API has keys, so every job carries its key's tenant; open mode's jobs have none)."""
    return setting if setting is not None else tenant != ""


@dataclass
class Plan(Generic[T]):
    """Where a read's tokenized jobs go: to the schedulers now, into the hold, or parked in Redis."""

    send: list[T] = field(default_factory=list)
    hold: list[T] = field(default_factory=list)
    park: list[T] = field(default_factory=list)
    kept: list[T] = field(default_factory=list)  # held already (services/tokenizer/holding.py `plan`): stays held


def plan(jobs: Iterable[tuple[str, bool, T]], lanes: dict[str, int], parked: Collection[str], max_held: int
         ) -> Plan[T]:
    """Each (tenant, fair queueing applies, job) sent, held or parked, in order (`holds`)."""
    out: Plan[T] = Plan()
    lanes, parked = dict(lanes), set(parked)
    for tenant, fair, job in jobs:
        if not fair:
            out.send.append(job)
        elif holds(lanes, tenant, parked, max_held):
            out.hold.append(job)
            lanes[tenant] = lanes.get(tenant, 0) + 1
        else:
            out.park.append(job)
            parked.add(tenant)
    return out


def holds(lanes: dict[str, int], tenant: str, parked: Collection[str], max_held: int) -> bool:
    """Whether a new job of `tenant` is held in memory (else parked), given the jobs held per tenant (`lanes`) and
    the tenants with jobs parked. Within --fair-max-held, yes, unless its tenant has jobs parked (they go first).
    Past it, only a tenant under its share of it (--fair-max-held over the tenants held, itself included), and never
    past twice the cap."""
    if tenant in parked:
        return False
    held = sum(lanes.values())
    if held < max_held:
        return True
    share = max_held // len(lanes.keys() | {tenant})
    return lanes.get(tenant, 0) < share and held < 2 * max_held


def refills(lanes: dict[str, int], parked: Iterable[str], targets: dict[str, int], max_held: int) -> dict[str, int]:
    """How many parked jobs to read back per tenant: each lane topped up to its target (`targets`, of each parked
    tenant), the emptiest first, while the hold is under --fair-max-held."""
    room = max_held - sum(lanes.values())
    out: dict[str, int] = {}
    for tenant in sorted(parked, key=lambda t: (lanes.get(t, 0), t)):
        want = min(room, targets[tenant] - lanes.get(tenant, 0))
        if want > 0:
            out[tenant] = want
            room -= want
    return out


class FairQueue(Generic[T]):
    """Lanes of items per tenant, served in weighted turns (module doc). A lane is dropped once empty, and a
    tenant whose lane is new joins at the end of the round."""

    def __init__(self, due: Callable[[T], float] = lambda _: math.inf) -> None:
        self.due = due  # an item's deadline (module doc): earlier first within its lane; infinity keeps it FIFO
        self._lanes: OrderedDict[str, deque[T]] = OrderedDict()  # the round, in turn order: the head's turn now
        self._weights: dict[str, int] = {}
        self._left = 0  # items the head lane may still release in its turn

    def __len__(self) -> int:
        return sum(len(lane) for lane in self._lanes.values())

    def push(self, tenant: str, weight: int, item: T) -> None:
        """Queue `item` in its tenant's lane: after every item due no later than it (the end, for one with no
        deadline); the job's latest weight is the lane's."""
        lane = self._lanes.setdefault(tenant, deque())
        due, at = self.due(item), len(lane)
        while at and due < self.due(lane[at - 1]):
            at -= 1
        lane.insert(at, item)
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
