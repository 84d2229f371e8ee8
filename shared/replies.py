"""A request's reply stream read in order: per choice, in token-index order, each range once, and fenced.

Stages may write a range twice (a peer replica redoing a dead one's work) or out of order (a gap a peer
fills after claiming it); events carry [start, end) token ranges, so a reader delivers each choice's events
in order, holds early ones and drops what it already delivered.

Fencing: a scheduler that takes a request over raises its epoch (the record's `epoch`, HINCRBY) and writes a
`fence` entry with it into the reply stream before it reads the stream to resume. Every event carries the
epoch of the scheduler that made its tokens. A reader that has passed a fence of epoch e refuses every
later event of an older epoch and forgets what it held of one: those are the taken-over scheduler's, which
may differ from its successor's (sampling) and would otherwise interleave with them. What came before the
fence is exactly what the successor resumed from, so the two never both reach a client.

The API reads with this to deliver; a resuming scheduler reads with it (and with `checkpoint` entries, which
carry every token so far, because the stream is capped) to know where to resume. Both see the same tokens.
"""

from __future__ import annotations

import logging

import msgspec

from shared.messages import ReplyCheckpoint, ReplyEvent

log = logging.getLogger(__name__)


class OrderedReplies:
    def __init__(self, n: int):
        self.next = [0] * n  # next token index to deliver, per choice
        self.held: list[dict[int, ReplyEvent]] = [{} for _ in range(n)]
        self.finished: dict[int, str] = {}
        self.prompt_tokens = 0
        self.cached_tokens = 0  # of the prompt, read from the engine's prefix cache
        self.epoch = 0  # the newest fence passed
        self.refused = 0  # events of a taken-over scheduler, refused after its successor's fence
        self.headless: set[int] | None = None  # choices not seen yet, when the stream's head was trimmed
        self.head_unsure = False  # a reattach's reader: the head may be trimmed before its first read

    def start_headless(self) -> None:
        """Read a stream whose head MAXLEN trimmed away: each choice starts where its first range seen starts
        (what came before was delivered to the client, which reattaches after it)."""
        self.headless = set(range(len(self.next)))

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.next)

    def fence(self, epoch: int) -> None:
        if epoch <= self.epoch:
            return
        self.epoch = epoch
        for held in self.held:
            for start in [s for s, ev in held.items() if ev.epoch < epoch]:
                del held[start]

    def accept(self, ev: ReplyEvent) -> list[ReplyEvent]:
        """Events now deliverable, in order, after receiving `ev`."""
        i = ev.index
        if not 0 <= i < len(self.next) or i in self.finished:
            return []
        if ev.epoch < self.epoch:
            self.refused += 1
            return []
        if ev.epoch > self.epoch:  # its fence came first in the stream, even if MAXLEN trimmed it away since
            self.fence(ev.epoch)
        if self.headless and i in self.headless:
            self.headless.discard(i)
            self.next[i] = max(self.next[i], ev.start)
        self.prompt_tokens = max(self.prompt_tokens, ev.prompt_tokens)
        self.cached_tokens = max(self.cached_tokens, ev.cached_tokens)
        if ev.finish_reason is not None and not ev.ids and ev.start <= self.next[i]:
            self.finished[i] = ev.finish_reason  # an abort or error ends the choice where it stands
            self.held[i].clear()
            return [ev]
        if ev.end < self.next[i] or (ev.end == self.next[i] and ev.finish_reason is None):
            return []  # already delivered
        if ev.start > self.next[i]:
            self.held[i][ev.start] = ev  # a gap before it: wait for the range a peer will redo
            return []
        if ev.start < self.next[i]:
            # Overlaps what was delivered; its text cannot be split by token. Whoever wrote the part we
            # have also writes the rest in step-sized ranges, which do fit.
            log.warning("dropping reply range [%d, %d) overlapping delivered %d", ev.start, ev.end, self.next[i])
            return []
        out = [ev]
        self._advance(ev)
        while i not in self.finished and (nxt := self.held[i].pop(self.next[i], None)) is not None:
            out.append(nxt)
            self._advance(nxt)
        return out

    def _advance(self, ev: ReplyEvent) -> None:
        self.next[ev.index] = max(self.next[ev.index], ev.end)
        if ev.finish_reason is not None:
            self.finished[ev.index] = ev.finish_reason
            self.held[ev.index].clear()

    @property
    def completion_tokens(self) -> int:
        return sum(self.next)


class ProducedTokens(OrderedReplies):
    """The tokens each choice has in a reply stream, as a scheduler resuming the request needs them: the
    events the API would deliver, plus checkpoints (the stream is capped, so its head may be gone)."""

    def __init__(self, n: int):
        super().__init__(n)
        self.outputs: list[list[int]] = [[] for _ in range(n)]
        self.failed = False

    def add(self, msg: object) -> None:
        from shared.messages import ReplyError, ReplyFence

        if isinstance(msg, ReplyError):
            self.failed = True
        elif isinstance(msg, ReplyFence):
            self.fence(msg.epoch)
        elif isinstance(msg, ReplyCheckpoint):
            self.checkpoint(msg)
        elif isinstance(msg, ReplyEvent):
            for ev in self.accept(self._beyond_next(msg)):
                self.outputs[ev.index].extend(ev.ids[len(self.outputs[ev.index]) - ev.start:])

    def _beyond_next(self, ev: ReplyEvent) -> ReplyEvent:
        # A checkpoint may land in the stream after deltas that straddle it (the scheduler writes checkpoints,
        # the detokenizer writes deltas, later): the tokens past the checkpoint are still needed, and only ids
        # matter here, not text.
        i = ev.index
        if 0 <= i < len(self.next) and ev.start < self.next[i] < ev.end and ev.ids:
            return msgspec.structs.replace(ev, start=self.next[i], ids=ev.ids[self.next[i] - ev.start:])
        return ev

    def checkpoint(self, ck: ReplyCheckpoint) -> None:
        if ck.epoch < self.epoch:
            return
        for i, ids in enumerate(ck.outputs[:len(self.next)]):
            if i not in self.finished and len(ids) > self.next[i]:
                self.outputs[i] = list(ids)
                self.next[i] = len(ids)
                for start in [s for s in self.held[i] if s < len(ids)]:
                    ev = self.held[i].pop(start)
                    if ev.end > len(ids):
                        self.held[i][len(ids)] = self._beyond_next(ev)
                while (nxt := self.held[i].pop(self.next[i], None)) is not None:
                    self.outputs[i].extend(nxt.ids)
                    self._advance(nxt)
