"""What the rest of the API knows of a request: `ApiRequest`, what the service needs of one (a single job's or a
group's), the batches of ordered events it yields, what an API process knows of one it follows (`RequestInfo`),
and its uid from a response id."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from services.api.answer.formats import Counts
from shared.messages import ReplyEvent, TokenizeJob

if TYPE_CHECKING:
    from services.api.multitenancy.quotas import Lease

Batch = list[tuple[str, ReplyEvent]]  # ordered events, each with the id of the reply entry that carried it
Writes = Callable[[Any], None]  # queues what a submission stores beside its record on the opening pipeline

UID_PREFIXES = ("chatcmpl-", "cmpl-", "msg_")


def bare_uid(uid: str) -> str:
    """The request's uid from a response id (`chatcmpl-<uid>`, `cmpl-<uid>`, a message's `msg_<uid>`) or the uid
    itself."""
    for prefix in UID_PREFIXES:
        uid = uid.removeprefix(prefix)
    return uid


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What an API process knows of a request it follows: from its job when it submits it (`of_job`), from its
    record when it attaches to one submitted anywhere (`of_record`)."""

    uid: str
    model: str
    n: int  # choices
    deadline: float  # unix s
    background: bool = False  # outlives its client
    slo_ttft_ms: int = 0  # its latency targets (services/api/answer/slo.py), enforced by the process that submits it
    slo_tpot_ms: int = 0
    created_at: float = 0.0  # unix s

    @classmethod
    def of_job(cls, job: TokenizeJob) -> RequestInfo:
        return cls(job.uid, job.model, job.params.n, job.deadline, job.background, job.slo_ttft_ms, job.slo_tpot_ms,
                   job.created_at)

    @classmethod
    def of_record(cls, uid: str, record: dict, timeout_s: float) -> RequestInfo:
        """`timeout_s` from now: the deadline of a record that names none."""
        return cls(uid, record.get("model", ""), int(record.get("n", 1)),
                   float(record.get("deadline", time.time() + timeout_s)), bool(int(record.get("background", 0))))


class ApiRequest(Protocol):
    """A request being answered: one job's (`SingleRequest`) or several prompts' as one (`RequestGroup`)."""

    uid: str
    model: str
    end_reason: str  # why it ended early, if it ends before its replies finished

    @property
    def counts(self) -> Counts: ...  # its usage so far (services/api/answer/formats.py takes it)

    @property
    def done(self) -> bool: ...

    def replies(self, idle_s: float | None = None) -> AsyncIterator[Batch]: ...

    def hold(self, lease: Lease | None) -> None: ...

    async def close(self, reason: str | None = None) -> None: ...
