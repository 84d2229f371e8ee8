"""Recovery's decisions without Redis (services/scheduler/recovery.py): poison entries, where a takeover resumes,
why a running request is no longer ours, and that the sweep hands what it finds back as data (Ends for the book,
effects for the writer) and never changes the book. What Redis does with them is test_recovery.py's subject."""

from __future__ import annotations

import time

import msgspec
import pytest

from services.scheduler.arrivals import Found
from services.scheduler.book import Running
from services.scheduler.effects import DeadLetter, Fail, RefreshTtl
from services.scheduler.recovery import Recovery, found_of, orphan_reason, poisoned, resumed_from
from shared import streams
from shared.consumer_group import Delivery
from shared.keys import Keys
from shared.messages import ReplyCheckpoint, ReplyEvent, encode
from shared.request_states import EndReason
from tests.unit.scheduler.test_book import admitted, book_of, delivery, job

pytestmark = pytest.mark.timeout(30)


def test_entries_delivered_more_than_the_limit_are_dead_lettered_and_failed_the_rest_kept():
    batch = [delivery("a", "1-0"), delivery("b", "2-0"), delivery("c", "3-0")]
    verdict = poisoned(batch, {"1-0": 4, "2-0": 3}, max_deliveries=3)
    assert [d.entry_id for d in verdict.kept] == ["2-0", "3-0"] and verdict.uids == ["a"]
    dead, fail = verdict.effects
    assert isinstance(dead, DeadLetter) and [(e, why) for e, _, why in dead.entries] == [
        ("1-0", "delivered 4 times; each scheduler died with it")]
    assert isinstance(fail, Fail) and fail.uid == "a" and fail.error.code == "request_dead_lettered"
    clean = poisoned(batch, {"1-0": 1}, max_deliveries=3)
    assert clean.kept == batch and clean.uids == [] and clean.effects == []


def entry(msg) -> tuple[bytes, dict[bytes, bytes]]:
    return b"1-0", {streams.FIELD: encode(msg)}


def test_a_takeover_resumes_from_the_ranges_before_its_fence_under_its_epoch():
    before = [entry(ReplyEvent(start=0, end=2, text="ab", ids=[21, 22], prompt_tokens=3)),
              (b"2-0", {streams.FIELD: b"not a reply"}),  # skipped, as the client's reader skips it
              entry(ReplyEvent(start=2, end=3, text="c", ids=[23], prompt_tokens=3))]
    resumed = resumed_from(1, 2, False, before)
    assert resumed.epoch == 2 and resumed.produced.outputs == [[21, 22, 23]]
    trimmed = resumed_from(1, 1, True, [entry(ReplyCheckpoint(epoch=0, outputs=[[21, 22, 23, 24]])),
                                        entry(ReplyEvent(start=4, end=5, text="d", ids=[25], prompt_tokens=3))])
    assert trimmed.produced.outputs == [[21, 22, 23, 24, 25]] and not trimmed.produced.unresumable


def test_why_a_running_request_is_no_longer_ours():
    def run(epoch: int = 1, background: bool = True) -> Running:
        return Running("1-0", msgspec.structs.replace(job("u"), background=background), [[]], epoch=epoch)

    assert orphan_reason(run(), None, None, {"api-x"}, "s1") == EndReason.RECORD_LOST
    assert orphan_reason(run(), b"s2", b"1", {"api-x"}, "s1") == EndReason.TAKEN_OVER
    assert orphan_reason(run(), b"s1", b"2", {"api-x"}, "s1") == EndReason.TAKEN_OVER  # fenced by a dead peer
    assert orphan_reason(run(background=False), b"s1", b"1", set(), "s1") == EndReason.OWNER_GONE
    assert orphan_reason(run(), b"s1", b"1", set(), "s1") is None  # a background request outlives its API
    assert orphan_reason(run(), b"s1", b"1", {"api-x"}, "s1") is None


class FakeRedis:
    """A request store's Redis that answers the sweep's reads from dicts (key -> value), no server."""

    def __init__(self, values: dict[str, object]):
        self.keys, self.ttl, self.redis = Keys("t"), 600.0, self
        self.values, self.queued = values, []

    def pipeline(self, transaction: bool = False) -> FakeRedis:
        return self

    async def __aenter__(self) -> FakeRedis:
        self.queued = []
        return self

    async def __aexit__(self, *exc) -> None:
        return None

    def get(self, key: str) -> None:
        self.queued.append(self.values.get(key))

    def hmget(self, key: str, fields: list[str]) -> None:
        self.queued.append(self.values.get(key, [None] * len(fields)))

    def exists(self, key: str) -> None:
        self.queued.append(int(key in self.values))

    async def execute(self) -> list:
        return self.queued


async def test_the_sweep_returns_ends_and_ttl_refreshes_and_leaves_the_book_alone():
    book, adm = book_of()
    admitted(book, adm, delivery("a", "1-0"), delivery("b", "2-0"), delivery("c", "3-0", n=2, stop=["zz"]))
    book.running["a"].refreshed -= 100
    k = Keys("t")
    redis = FakeRedis({k.request("a"): [b"s1", b"0"], k.abort("b"): b"client_gone", k.request("c"): [b"s2", b"0"],
                       k.choice_stop("c", 1): 1, k.worker("api", "api-x"): 1})
    recovery = Recovery(redis, None, "s1", max_deliveries=3)  # type: ignore[arg-type]
    before = dict(book.running)
    ends, effects = await recovery.sweep(book.sweep_view(book.running["b"].refreshed + 50, 60))
    # b: its flag's reason wins over its lost record; c: a peer owns it now
    assert ends.requests == {"b": "client_gone", "c": EndReason.TAKEN_OVER} and ends.choices == {("c", 1)}
    assert effects == [RefreshTtl(["a"])]
    assert book.running == before and all(not s.ended for s in book.engine.running)  # the loop applies the ends
    _, again = await recovery.sweep(book.sweep_view(book.running["b"].refreshed + 50, 60))
    assert again == []  # marked refreshed by the book

async def test_an_api_pod_is_gone_once_two_sweeps_in_a_row_find_no_heartbeat_of_it():
    """A Redis restart can outlast the heartbeats' TTL: the first sweep after it may find no heartbeat of a live
    API pod that has not beaten again yet. Its requests end only when the next sweep does not find it either."""
    book, adm = book_of()
    admitted(book, adm, Delivery("1-0", msgspec.structs.replace(job("a"), background=False)))
    k = Keys("t")
    redis = FakeRedis({k.request("a"): [b"s1", b"0"]})  # the pod's heartbeat is not there
    recovery = Recovery(redis, None, "s1", max_deliveries=3)  # type: ignore[arg-type]
    view = lambda: book.sweep_view(time.monotonic(), 60)  # noqa: E731
    assert (await recovery.sweep(view()))[0].requests == {}  # not found once: it may be about to beat again
    redis.values[k.worker("api", "api-x")] = 1
    assert (await recovery.sweep(view()))[0].requests == {}  # it did
    del redis.values[k.worker("api", "api-x")]
    assert (await recovery.sweep(view()))[0].requests == {}
    assert (await recovery.sweep(view()))[0].requests == {"a": EndReason.OWNER_GONE}  # twice in a row: gone


def test_the_sweep_leaves_out_requests_admitted_less_than_a_sweep_ago():
    """Admission read a young request's abort flag and owner: the sweep reads them again only once it has run
    `settled_s` (a request shorter than that costs no sweep read); TTL refreshes still cover every request."""
    book, adm = book_of()
    admitted(book, adm, delivery("a", "1-0"), delivery("b", "2-0"))
    book.running["a"].admitted -= 5
    now = book.running["b"].admitted + 0.5
    assert list(book.sweep_view(now, 60, 1.0).running) == ["a"]
    assert sorted(book.sweep_view(now + 1, 60, 1.0).running) == ["a", "b"]
    book.running["b"].refreshed -= 100
    assert [r.job.uid for r in book.sweep_view(now, 60, 1.0).stale] == ["b"]


def test_what_redis_holds_of_a_delivered_request():
    assert found_of(None, [None, None]) == Found()
    assert found_of(b"client_gone", [b"s2", b"7-0"]) == Found("client_gone", "s2", "7-0")
