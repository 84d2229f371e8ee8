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

The API reads with this to deliver; a resuming scheduler reads with it to know where to resume, and both stop
at the same token. `checkpoint` entries, which carry every token so far, give the resuming scheduler only the
tokens before a capped stream's first range: they may run ahead of the ranges the API has (ProducedTokens).
"""

from __future__ import annotations

import logging

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
    """The tokens each choice has in a reply stream, as a scheduler resuming the request needs them: exactly the
    ranges the API delivers, so each choice resumes where its client stands.

    A checkpoint must never move that point forward. The scheduler writes it straight into the stream, ahead of
    the ranges of the same tokens that the detokenizer has yet to append; one that lands after the successor's
    fence is refused by every reader, so a successor resuming at the checkpoint would leave its client a gap
    that nothing ever fills. Checkpoints only supply the tokens before a trimmed stream's first range (MAXLEN
    took the head), and a fence passed keeps what its successor resumed from, as a checkpoint of its epoch.
    """

    def __init__(self, n: int, trimmed: bool = False):
        super().__init__(n)
        self.known: list[list[int]] = [[] for _ in range(n)]  # newest checkpoint of the epoch, or a fence's
        self.base = [0] * n  # where each choice's ranges start: past 0 only in a trimmed stream
        self.ranges: list[list[int]] = [[] for _ in range(n)]  # ids of the ranges delivered since `base`
        self.failed = False
        if trimmed:
            self.start_headless()

    @property
    def outputs(self) -> list[list[int]]:
        return [self._output(i) for i in range(len(self.next))]

    @property
    def unresumable(self) -> bool:
        """A trimmed stream whose first range of some choice lies past every checkpoint read."""
        return any(self.base[i] > len(self.known[i]) for i in range(len(self.next)))

    def _output(self, i: int) -> list[int]:
        if self.headless and i in self.headless:  # no range left of this choice: its newest checkpoint
            return list(self.known[i])
        return self.known[i][:self.base[i]] + self.ranges[i]

    def add(self, msg: object) -> None:
        from shared.messages import ReplyError, ReplyFence

        if isinstance(msg, ReplyError):
            self.failed = True
        elif isinstance(msg, ReplyFence):
            self.fence(msg.epoch)
        elif isinstance(msg, ReplyCheckpoint):
            if msg.epoch >= self.epoch:  # an older one after a fence is a taken-over scheduler's
                for i, ids in enumerate(msg.outputs[:len(self.next)]):
                    if len(ids) >= len(self.known[i]):
                        self.known[i] = list(ids)
        elif isinstance(msg, ReplyEvent):
            i = msg.index
            first = bool(self.headless) and i in self.headless
            for ev in self.accept(msg):
                if first and not (self.headless and i in self.headless):
                    self.base[i], first = ev.start, False
                self.ranges[ev.index].extend(ev.ids)

    def fence(self, epoch: int) -> None:
        if epoch > self.epoch and not self.unresumable:
            # What the successor resumed from is the truth from here on: later checkpoints of older epochs are
            # refused, and what an older one held past this point was never delivered.
            for i in range(len(self.next)):
                if not (self.headless and i in self.headless):  # those still start at their first range
                    self.known[i], self.base[i], self.ranges[i] = self._output(i), self.next[i], []
        super().fence(epoch)
