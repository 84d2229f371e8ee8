"""Detokenizer worker: consumer group `detokenizer` on rsinfer:detokenize:<model> -> rsinfer:reply:{<uid>}.

Each read is one batch of engine steps: contiguous tokens of a choice are merged into one reply entry,
all windows are decoded together, and one pipeline writes every reply entry (EXPIRE as a request starts, at most
every PROGRESS_EVERY_S while it runs, and at its end if none went for that long: not per token) and acknowledges
the read.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import msgspec

from services.detokenizer.incremental import Detokenizer, Rendered, merge_deltas
from shared.consumer_group import Delivery
from shared.keys import DETOKENIZER_GROUP
from shared.lru import ByteLRU
from shared.messages import DetokenizeBatch, ReplyEvent, TokenDelta
from shared.models import load_tokenizer, transformers_without_torch
from shared.request_states import EndReason, Finish, status_after
from shared.request_store import RequestStore
from shared.settings import DetokenizerSettings
from shared.worker import PushWorker, run_stage

log = logging.getLogger(__name__)

# How often a choice's progress (the record's completion_tokens, with the reply stream's TTL) is written while it
# runs: by time, not tokens, so that at a GPU's rates a request costs Redis the same few writes however fast it
# goes (every 64 tokens was 6 commands more per 256-token request at 5 ms steps; issue 34). The scheduler refreshes
# both TTLs of what it runs too (services/scheduler/recovery.py TTL_REFRESH_S).
PROGRESS_EVERY_S = 5.0
FINISHED_MEMORY = 50_000
# Stop strings by uid (shared/messages.py TokenDelta): every request in flight with stop strings, whatever they
# weigh (the API caps them; 32 MiB is 8k requests at 4 KiB each). A request dropped from here is read again from
# its record.
STOP_CACHE_ENTRIES = 50_000
STOP_CACHE_BYTES = 32 * 2**20
_STOPS = msgspec.json.Decoder(list[str])


class DetokenizerWorker(PushWorker[DetokenizeBatch]):
    role = "detokenizer"
    group = DETOKENIZER_GROUP
    message_type = DetokenizeBatch

    def __init__(self, settings: DetokenizerSettings, model_path: str, model_name: str):
        super().__init__(settings, model_name)
        self.detok = Detokenizer(load_tokenizer(model_path, settings.trust_remote_code))
        self.requests = RequestStore(self.redis, self.keys, self.ttl, self.maxlen)
        # Where choices this replica ended, and by which scheduler's epoch: that scheduler's later steps (made
        # before it saw a stop string's flag) are dropped; earlier ones (a claimed entry handled after newer
        # ones) and a successor's (after a takeover) still rendered. Bounded; the API also ignores anything
        # after a choice's final entry.
        self.finished: OrderedDict[tuple[str, int], tuple[int, int]] = OrderedDict()
        # Where this replica's last range of each choice in flight ends (merge_deltas keeps a step written twice
        # apart from new ones). Bounded like `finished`; a choice's entry goes when it ends.
        self.published: OrderedDict[tuple[str, int], int] = OrderedDict()
        # When this replica last wrote each running choice's progress (`_marks`), bounded like `published`
        self.marked: OrderedDict[tuple[str, int], float] = OrderedDict()
        self.stops: ByteLRU[str, list[str]] = ByteLRU(STOP_CACHE_ENTRIES, STOP_CACHE_BYTES)

    def load(self) -> dict:
        return {**super().load(), "finished_tracked": len(self.finished), "published_tracked": len(self.published),
                "marked_tracked": len(self.marked), "stops_cached": len(self.stops)}

    async def handle(self, batch: list[Delivery[DetokenizeBatch]], claimed: bool) -> None:
        items = await self._with_stops([it for d in batch for it in d.msg.items if not self._after_end(it)])
        # Claimed entries are rendered one step at a time: a dead peer may have written some of them
        # already, and equal ranges are what lets the API drop duplicates exactly.
        if not claimed:
            items = merge_deltas(items, self.published)
        spans = [self.tracer.start("detokenize", it.trace, uid=it.uid, choice=it.index, start=it.start,
                                   end=it.start + len(it.ids), finish=it.finish or "")
                 for it in items if it.trace]  # a choice's first and last range, when traced
        try:
            # In the loop, not a worker thread: a thread's hand-off (asyncio.to_thread) cost ~60 µs of CPU per read,
            # and a read's render holds the loop 0.2-1 ms at 64-256 streams, 4 ms at 512 (docs/design.md,
            # "Measured facts behind the design")
            rendered = self.detok.render(items) if items else []
            async with self.redis.pipeline(transaction=False) as pipe:
                now = time.monotonic()
                rows = [(it, r, self._marks(it, r, now)) for it, r in zip(items, rendered, strict=True)]
                self.requests.replies(pipe, [self._event(it, r, mark) for it, r, mark in rows])
                for it, r, mark in rows:
                    self._record(pipe, it, r, mark)
                self.source.ack_in(pipe, [d.entry_id for d in batch])
                await pipe.execute()
            self.metrics.published("reply", len(items))
            self._note_published(items)
            self._note_marked(rows, now)
        finally:
            for span in spans:
                span.end()

    async def _with_stops(self, items: list[TokenDelta]) -> list[TokenDelta]:
        """Each delta with its request's stop strings: from a choice's first delta, this replica's cache, or (one
        round trip for the whole read) the request records, which the scheduler wrote before any delta. Every
        replica renders a range with the same stop strings, however it learns them."""
        known: dict[str, list[str]] = {}
        for it in items:
            if it.stop and it.stops:
                known[it.uid] = it.stop
                self.stops.put(it.uid, it.stop, sum(len(x) for x in it.stop) + 64)
        wanted = [it for it in items if it.stops and not it.stop]
        if not wanted:
            return items
        for uid in {it.uid for it in wanted} - known.keys():
            if (cached := self.stops.get(uid)) is not None:
                known[uid] = cached
        missing = sorted({it.uid for it in wanted} - known.keys())
        if missing:
            found = await self.requests.field(missing, "stop")
            for uid in missing:
                raw = (found[uid] or "").encode()
                known[uid] = _STOPS.decode(raw) if raw else []
                if not known[uid]:  # the record is gone (the scheduler drops such a request within a second)
                    log.warning("uid=%s: stop strings not found in its record; rendered without them", uid)
                self.stops.put(uid, known[uid], len(raw) + 64)
        return [msgspec.structs.replace(it, stop=known[it.uid]) if it.stops and not it.stop else it for it in items]

    def _event(self, it: TokenDelta, r: Rendered, mark: bool) -> tuple[str, ReplyEvent, bool]:
        """The reply entry for `it`, and whether it refreshes the stream's TTL (`mark`)."""
        finish = Finish.STOP if r.stopped else it.finish
        end = it.start + len(it.ids)
        event = ReplyEvent(start=it.start, end=end, text=r.text, prompt_tokens=it.prompt_tokens,
                           index=it.index, ids=it.ids, finish_reason=finish, logprobs=self.detok.logprobs(it),
                           epoch=it.epoch, stop_sequence=r.stop, **self.detok.first_range(it))
        return it.uid, event, mark

    def _marks(self, it: TokenDelta, r: Rendered, now: float) -> bool:
        """Whether `it`'s entry sets the stream's TTL and the record's progress: a choice's first entry, one
        PROGRESS_EVERY_S after this replica last did (a choice it first sees mid-way starts the clock), and its
        last unless this replica set the TTL less than PROGRESS_EVERY_S before (it reaches past the end by the
        TTL less those seconds already; the record's end is written whatever this says). Reads `marked` only:
        `_note_marked` updates it once the read's pipeline has gone."""
        last = self.marked.get((it.uid, it.index))
        if it.start == 0 or last is None:
            return it.start == 0 or r.stopped or it.finish is not None
        return now - last >= PROGRESS_EVERY_S

    def _record(self, pipe, it: TokenDelta, r: Rendered, mark: bool) -> None:
        """The request record (and, on a stop string, the engine) after `it`'s entry."""
        finish = Finish.STOP if r.stopped else it.finish
        end = it.start + len(it.ids)
        if finish is not None:
            # One choice: the sum of its choices' tokens is its own, written with its end (not an HINCRBY more)
            self.requests.set_status(pipe, it.uid, status_after(finish), finish_reason=finish,
                                     completion_tokens=end, generated_tokens=end if it.n == 1 else None)
            if it.n > 1:
                self.requests.count_generated(pipe, it.uid, end)
            self._remember(it, end)
            if it.n == 1:  # its last range (one redone later reads the record again)
                self.stops.pop(it.uid)
            if r.stopped and it.finish is None:
                log.info("uid=%s choice=%d stop string at token %d", it.uid, it.index, end)
                self._stop_engine(pipe, it)
        elif mark and it.start:  # the scheduler wrote the record as the request started
            self.requests.set_status(pipe, it.uid, completion_tokens=end)

    def _stop_engine(self, pipe, it: TokenDelta) -> None:
        """Tell the scheduler to stop spending compute on this choice: the request's abort flag with reason
        "stop" when it has one choice, else the choice's own stop flag (one flag would stop them all)."""
        if it.n == 1:
            self.requests.abort(pipe, it.uid, EndReason.STOP, self.model_name)
        else:
            self.requests.stop_choice(pipe, it.uid, it.index, self.model_name)

    def _note_published(self, items: list[TokenDelta]) -> None:
        for it in items:
            key = (it.uid, it.index)
            if it.finish is not None or key in self.finished:
                self.published.pop(key, None)
                continue
            end = it.start + len(it.ids)
            if end > self.published.get(key, -1):
                self.published[key] = end
                self.published.move_to_end(key)
        while len(self.published) > FINISHED_MEMORY:
            self.published.popitem(last=False)

    def _note_marked(self, rows: list[tuple[TokenDelta, Rendered, bool]], now: float) -> None:
        """After a read's pipeline: when each running choice's progress was written (or first seen); an ended
        choice's entry goes. A pipeline that failed changed nothing, so its retry decides the marks again."""
        for it, r, mark in rows:
            key = (it.uid, it.index)
            if r.stopped or it.finish is not None:
                self.marked.pop(key, None)
            elif mark or key not in self.marked:
                self.marked[key] = now
                self.marked.move_to_end(key)
        while len(self.marked) > FINISHED_MEMORY:
            self.marked.popitem(last=False)

    def _after_end(self, it: TokenDelta) -> bool:
        epoch, end = self.finished.get((it.uid, it.index), (-1, 0))
        return it.epoch <= epoch and it.start >= end

    def _remember(self, it: TokenDelta, end: int) -> None:
        self.finished[(it.uid, it.index)] = (it.epoch, end)
        while len(self.finished) > FINISHED_MEMORY:
            self.finished.popitem(last=False)


def run(settings: DetokenizerSettings) -> int:
    async def build(model_path: str, model_name: str) -> DetokenizerWorker:
        transformers_without_torch()  # this stage never runs a model
        return DetokenizerWorker(settings, model_path, model_name)

    return run_stage(settings, build)
