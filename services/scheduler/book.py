"""The scheduler's request book: the requests this scheduler runs, and what each engine step and each end means
for Redis, returned as effects (services/scheduler/effects.py), never written here. Requests come in through
admission (services/scheduler/arrivals.py).

It aborts requests in the engine (between steps); it never steps the engine and never touches Redis: what Redis
said comes in as arguments (`Ends`), so tests/unit/scheduler/test_book.py runs it with the synthetic engine alone.
"""

from __future__ import annotations

import base64
import logging
import time
from dataclasses import dataclass, field

from services.scheduler.effects import Ack, Checkpoint, Effect, Fail, Pooled, Publish, RecordAbort
from services.scheduler.engine.base import Engine, StepOutput
from shared.messages import ReplyCheckpoint, ReplyError, ReplyEvent, ScheduleJob, TokenDelta
from shared.request_states import EndReason, Finish, Status
from shared.request_store import deadline_error
from shared.tracing import NO_SPAN, Span

log = logging.getLogger(__name__)

# Tokens sent before each delta so detokenizing needs no state. They must span the detokenizer's
# held-back tail (up to 3 U+FFFD) plus a character cut at the window's start (or one the prompt left
# unfinished): 8 do.
CONTEXT_TOKENS = 8


@dataclass
class Ends:
    """Requests to drop (uid -> reason) and choices a stop string ended, learned between two steps."""

    requests: dict[str, str] = field(default_factory=dict)
    choices: set[tuple[str, int]] = field(default_factory=set)

    def add_note(self, note: dict[str, str], running: dict) -> None:
        """An abort notification (shared/request_store.py `abort`, `stop_choice`) about one of ours, if it is."""
        uid = note.get("uid", "")
        if uid not in running:
            return
        if "choice" in note:
            self.choices.add((uid, int(note["choice"])))
        else:
            self.requests[uid] = note.get("reason", EndReason.ABORTED)

    def __or__(self, other: Ends) -> Ends:
        """Both; where both end a request, this one's reason."""
        return Ends({**other.requests, **self.requests}, self.choices | other.choices)


@dataclass
class SweepView:
    """What recovery's sweep (services/scheduler/recovery.py) asks about, from the book (`RequestBook.sweep_view`)."""

    running: dict[str, Running]
    stoppable: list[tuple[str, int]]  # open choices a stop string may end alone
    stale: list[Running]  # due for a refresh of their keys' TTLs


@dataclass
class Running:
    """What the scheduler keeps per admitted request: enough to publish, acknowledge and resume."""

    entry_id: str
    job: ScheduleJob
    outputs: list[list[int]]
    done: set[int] = field(default_factory=set)
    span: Span = NO_SPAN  # from admission to the request's end, when traced
    steps: int = 0  # engine steps that produced tokens for it
    epoch: int = 0  # raised by every takeover; on every delta, so a successor's fence refuses ours
    # Tokens (all choices) at the last checkpoint written to the reply stream; those it starts with (resumed
    # after a takeover) are in the reply stream already.
    checkpointed: int = field(init=False)
    prompt_scores: list | None = None  # echo with logprobs: choice 0's, for every choice's first delta
    refreshed: float = field(default_factory=time.monotonic)  # when its keys' TTLs were last set
    admitted: float = field(default_factory=time.monotonic)  # when this scheduler looked it up and started it
    window: int = field(init=False)  # completion tokens sent before each delta (`context`)

    def __post_init__(self) -> None:
        self.window = CONTEXT_TOKENS + stop_span(self.job.params.stop)
        self.checkpointed = sum(len(o) for o in self.outputs)

    def context(self, seq: list[int], start: int) -> list[int]:
        """The tokens before completion token `start` that it is decoded after: the completion's last
        `window`, and while the completion is shorter than CONTEXT_TOKENS the prompt's last tokens before
        them up to that count (as vLLM and SGLang seed their detokenizers with the prompt's tail), since
        SentencePiece-style tokenizers drop the leading space of a window's first word. A function of
        (prompt, completion, start) only, so a peer resuming the request sends the same windows."""
        context = seq[max(0, start - self.window):start]
        if start < CONTEXT_TOKENS:
            prompt = self.job.input_ids
            context = prompt[max(0, len(prompt) - (CONTEXT_TOKENS - start)):] + context
        return context

    def delta(self, out: StepOutput) -> TokenDelta:
        context = self.context(self.outputs[out.index], out.start)
        p = self.job.params
        first: dict = {}
        if out.start == 0:  # what a choice's first delta tells: cache hits, and the prompt for echo
            self.prompt_scores = out.prompt_logprobs or self.prompt_scores
            first = {"cached_tokens": out.cached_tokens, "prompt_ids": self.job.input_ids if p.echo else None,
                     "prompt_logprobs": self.prompt_scores if p.prompt_logprobs is not None else None}
        edge = out.start == 0 or out.finish_reason is not None  # the detokenizer traces these
        # The stop strings go with a choice's first delta only; the others say how many there are, and a
        # detokenizer that lacks them reads them from the record (shared/messages.py TokenDelta).
        return TokenDelta(uid=self.job.uid, start=out.start, ids=out.ids, prompt_tokens=len(self.job.input_ids),
                          index=out.index, n=p.n, context=context, finish=out.finish_reason,
                          stop=p.stop if out.start == 0 else [], stops=len(p.stop),
                          skip_special_tokens=p.skip_special_tokens, logprobs=out.logprobs,
                          top_logprobs=out.top_logprobs, trace=self.job.trace if edge else None,
                          epoch=self.epoch, **first)

    def count_step(self) -> None:
        """One more engine step made tokens for it (the first is its span's `first_tokens`)."""
        self.steps += 1
        if self.steps == 1:
            self.span.event("first_tokens")

    def extend(self, out: StepOutput) -> bool:
        """Add one choice's tokens of a step; whether every choice has now finished."""
        self.outputs[out.index].extend(out.ids)
        if out.finish_reason is None:
            return False
        self.done.add(out.index)
        return len(self.done) == self.job.params.n

    def end_span(self, outcome: str, error: str | None = None) -> None:
        self.span.set(outcome=outcome, steps=self.steps, completion_tokens=sum(len(o) for o in self.outputs))
        self.span.end(error)

    def abort_deltas(self) -> list[TokenDelta]:
        """A final `Finish.ABORT` for every choice still open, so the client's reply ends in order."""
        return [TokenDelta(uid=self.job.uid, start=len(seq), ids=[], prompt_tokens=len(self.job.input_ids),
                           index=i, n=self.job.params.n, finish=Finish.ABORT, epoch=self.epoch)
                for i, seq in enumerate(self.outputs) if i not in self.done]

    def checkpoint_due(self, every: int) -> ReplyCheckpoint | None:
        """After `every` more tokens (of all choices; at least 16 per choice), all tokens so far: a successor
        resumes from the newest one, so resuming never depends on the head of a capped reply stream."""
        total = sum(len(o) for o in self.outputs)
        if total - self.checkpointed < max(every, 16 * self.job.params.n):
            return None
        self.checkpointed = total
        return ReplyCheckpoint(epoch=self.epoch, outputs=[list(o) for o in self.outputs])


class Unsent:
    """Each open choice's tokens not published yet, merged over steps: --stream-interval N (steps) and
    --stream-flush-ms (how long a token may wait), paced by --stream-entry-rate. Either, where set, sends them."""

    def __init__(self, interval: int, flush_s: float = 0.0, entry_rate: float = 0.0):
        self.interval, self.flush_s, self.entry_rate = interval, flush_s, entry_rate
        self.merging = interval > 1 or flush_s > 0
        # (uid, index) -> (the merged output, how many steps it holds, when its oldest token was made)
        self.held: dict[tuple[str, int], tuple[StepOutput, int, float]] = {}
        self.last: float | None = None  # when the previous step's outputs came
        self.gap = float("inf")  # the time between the last two steps: how long holding a token delays it
        self.hold_s = flush_s  # how long a token may wait now: the flush interval, or less where pacing says so

    def clock(self, now: float, choices: int = 0) -> None:
        """A step's outputs (for `choices` choices) came at `now` (monotonic): its gap to the previous one is the
        next step's expected. Paced, a token waits as long as keeps this scheduler's deltas near --stream-entry-rate
        per second (one per choice per hold: `choices` / rate), at most the flush interval: a few streams publish
        every step, hundreds merge steps, where each delta's cost downstream (detokenizer, reply entry, SSE chunk,
        Redis commands) adds up."""
        self.gap = float("inf") if self.last is None else now - self.last
        self.last = now
        if self.entry_rate > 0:
            self.hold_s = min(self.flush_s, choices / self.entry_rate)

    def due(self, out: StepOutput, now: float = 0.0) -> StepOutput | None:
        """A choice's tokens wait until N steps' worth are merged into one output, or until holding them to the
        next step would make the oldest wait longer than the flush interval; its first output (time to first
        token) and its last go at once. None while they wait."""
        if not self.merging:
            return out
        key = (out.uid, out.index)
        if key in self.held:
            held, steps, since = self.held.pop(key)
            out, steps = merge_outputs(held, out), steps + 1
        else:
            steps, since = 1, now
        if out.start == 0 or out.finish_reason is not None or self.ripe(steps, since, now):
            return out
        self.held[key] = (out, steps, since)
        return None

    def ripe(self, steps: int, since: float, now: float) -> bool:
        if self.flush_s > 0 and now - since + self.gap > self.hold_s:
            return True
        return self.interval > 1 and steps >= self.interval

    def overdue(self, now: float) -> list[StepOutput]:
        """Remove and return the choices due by time that this step made no tokens for (e.g. preempted): they
        do not wait for their next."""
        if self.flush_s <= 0 or not self.held:
            return []
        keys = [k for k, (_, _, since) in self.held.items() if now - since + self.gap > self.hold_s]
        return [self.held.pop(k)[0] for k in keys]

    def holds(self, uid: str, n: int) -> bool:
        """Whether any of the request's n choices has tokens not published yet."""
        return bool(self.held) and any((uid, i) in self.held for i in range(n))

    def take(self, uid: str, index: int | None = None) -> list[StepOutput]:
        """Remove and return the request's (or one choice's) tokens not published yet."""
        keys = [k for k in self.held if k[0] == uid and index in (None, k[1])]
        return [self.held.pop(k)[0] for k in keys]

    def take_all(self) -> list[StepOutput]:
        out = [o for o, _, _ in self.held.values()]
        self.held.clear()
        return out


class RequestBook:
    """The requests this scheduler runs (`running`, uid -> Running) and their tokens not published yet."""

    def __init__(self, engine: Engine, scheduler_id: str, checkpoint_every: int, unsent: Unsent | None = None):
        self.engine, self.id = engine, scheduler_id
        self.checkpoint_every = checkpoint_every  # tokens between two checkpoints in a reply stream
        self.running: dict[str, Running] = {}
        self.unsent = unsent or Unsent(1)  # without one: a delta per step

    def held_entries(self) -> list[str]:
        return [r.entry_id for r in self.running.values()]

    def add(self, run: Running) -> None:
        """A request admission handed to the engine (services/scheduler/arrivals.py `start`)."""
        self.running[run.job.uid] = run

    def forget(self, uid: str) -> None:
        """Whatever the engine and the book hold of a request that fails at admission."""
        self.engine.abort(uid)
        self.unsent.take(uid)
        run = self.running.pop(uid, None)
        if run is not None:
            run.end_span(Status.FAILED)

    def roll_back(self, uids: list[str]) -> None:
        """Requests started by an admission whose writes Redis refused: they run only once recorded."""
        for uid in uids:
            if (run := self.running.pop(uid, None)) is not None:
                self.engine.abort(uid)
                run.end_span(EndReason.NOT_ADMITTED)

    # -- engine steps ---------------------------------------------------------------------------------
    def failed_step(self, error: Exception) -> list[StepOutput]:
        """The engine cannot tell whose fault a failed step was: an error for every choice it held."""
        return [StepOutput(uid, len(run.outputs[i]), [], i, Finish.ERROR, error=f"engine error: {error}")
                for uid, run in self.running.items() for i in range(run.job.params.n) if i not in run.done]

    def stepped(self, outputs: list[StepOutput], step: int, now: float = 0.0) -> list[Effect]:
        """What one engine step made (its effects computed at `now`, a monotonic clock): requests failed, one
        Publish of its deltas and of the merged tokens now due, the checkpoints due, and the acknowledgement of
        the requests it ended."""
        effects: list[Effect] = []
        items: list[TokenDelta] = []
        ended: list[str] = []
        stepped: set[str] = set()
        self.unsent.clock(now, len(outputs))
        for out in outputs:
            run = self.running.get(out.uid)
            if run is None or out.index in run.done:
                continue
            if out.error is not None:
                effects += self.fail(out.uid, out.error, out.error_status, out.error_param)
                continue
            if out.embedding is not None or out.scores is not None:
                effects += self.pooled(out)
                continue
            if out.uid not in stepped:
                stepped.add(out.uid)
                run.count_step()
            if (due := self.unsent.due(out, now)) is not None:
                items.append(run.delta(due))
            if run.extend(out):
                ended.append(self.running.pop(out.uid).entry_id)
                run.end_span(Status.FINISHED)
        items += [self.running[o.uid].delta(o) for o in self.unsent.overdue(now) if o.uid in self.running]
        return effects + self.published(items, step, ended)

    def pooled(self, out: StepOutput) -> list[Effect]:
        """A prefill-only request ended with its one output: its answer goes to its reply stream, not to a
        detokenizer (shared/messages.py Pooling)."""
        run = self.running.pop(out.uid)
        run.count_step()
        run.end_span(Status.FINISHED)
        vector = base64.b64encode(out.embedding).decode() if out.embedding is not None else None
        event = ReplyEvent(start=0, end=0, text="", prompt_tokens=len(run.job.input_ids), finish_reason=Finish.STOP,
                           cached_tokens=out.cached_tokens, epoch=run.epoch, embedding=vector, scores=out.scores)
        return [Pooled(out.uid, event), Ack([run.entry_id])]

    def published(self, items: list[TokenDelta], step: int, ended: list[str]) -> list[Effect]:
        """A step's deltas as one Publish, the checkpoints now due of the requests in it, and the acknowledgement
        of the requests it ended (after both)."""
        effects: list[Effect] = [Publish(items, step)] if items else []
        # A checkpoint claims every token so far, and a successor resumes after it: none may still be unsent.
        effects += [Checkpoint(uid, ck) for uid in {it.uid for it in items}
                    if uid in self.running and not self.unsent.holds(uid, self.running[uid].job.params.n)
                    and (ck := self.running[uid].checkpoint_due(self.checkpoint_every))]
        if ended:
            effects.append(Ack(ended))
        return effects

    def fail(self, uid: str, error: str, status: int = 500, param: str | None = None) -> list[Effect]:
        self.unsent.take(uid)
        run = self.running.pop(uid)
        self.engine.abort(uid)
        run.end_span(Status.FAILED, error)
        if status < 500:  # the request's own fault (e.g. its grammar): a 400, one line
            log.info("uid=%s refused by the engine: %s", uid, error)
            code = "model_not_found" if status == 404 else (  # a LoRA adapter unloaded while it waited
                "invalid_constraint" if error.startswith("structured output") else None)
            reply = ReplyError(message=error, status=status, type="invalid_request_error", param=param, code=code)
        else:
            log.error("uid=%s failed in the engine: %s", uid, error)
            reply = ReplyError(message=error)
        return [Fail(uid, reply), Ack([run.entry_id])]

    def unsent_now(self, step: int) -> list[Effect]:
        """Every choice's tokens not published yet, at once (a drain hands the requests back after these)."""
        items = [self.running[o.uid].delta(o) for o in self.unsent.take_all() if o.uid in self.running]
        return [Publish(items, step)] if items else []

    # -- ends -----------------------------------------------------------------------------------------
    def ends_due(self, now: float, taken: set[str]) -> Ends:
        """Requests past their deadline, and those whose entry a peer claimed from us (`taken`)."""
        ends = Ends({uid: EndReason.TIMEOUT for uid, r in self.running.items() if r.job.deadline <= now})
        ends.requests |= {uid: EndReason.TAKEN_OVER for uid, r in self.running.items() if r.entry_id in taken}
        return ends

    def stoppable(self) -> list[tuple[str, int]]:
        """The open choices of n > 1 requests with stop strings: a stop string may end one alone."""
        return [(uid, i) for uid, r in self.running.items() if r.job.params.n > 1 and r.job.params.stop
                for i in range(r.job.params.n) if i not in r.done]

    def sweep_view(self, now: float, refresh_every: float, settled_s: float = 0.0) -> SweepView:
        """What the sweep checks: the requests running for `settled_s` or more (admission read a younger one's
        flag and owner: the next sweep is soon enough, and a request shorter than that costs no sweep read), the
        choices a stop string may end, and the requests whose TTLs are due for a refresh (marked refreshed: the
        sweep's effects refresh them)."""
        settled = {uid: r for uid, r in self.running.items() if now - r.admitted >= settled_s}
        return SweepView(settled, self.stoppable(), self.stale(now, refresh_every))

    def stale(self, now: float, every: float) -> list[Running]:
        """The requests whose keys' TTLs are due for a refresh (marked refreshed: the caller refreshes them)."""
        runs = [r for r in self.running.values() if now - r.refreshed >= every]
        for r in runs:
            r.refreshed = now
        return runs

    def end(self, ends: Ends, step: int) -> list[Effect]:
        effects: list[Effect] = []
        for uid, index in ends.choices:
            effects += self.stop_choice(uid, index)
        for uid, reason in ends.requests.items():
            if uid in self.running:
                effects += self.drop(uid, reason, step)
        return effects

    def stop_choice(self, uid: str, index: int) -> list[Effect]:
        """A stop string ended this choice in the detokenizer (which wrote its last range): stop generating it,
        and end the request if it was the last one open."""
        run = self.running.get(uid)
        if run is None or index in run.done:
            return []
        self.engine.abort(uid, index)
        self.unsent.take(uid, index)  # past the stop string: the detokenizer would drop them
        run.done.add(index)
        log.info("uid=%s choice=%d stopped by a stop string", uid, index)
        if len(run.done) < run.job.params.n:
            return []
        del self.running[uid]
        run.end_span(Status.FINISHED)
        return [Ack([run.entry_id])]

    def drop(self, uid: str, reason: str, step: int) -> list[Effect]:
        """End a running request here: the engine lets it go, and its client learns why."""
        unsent = self.unsent.take(uid)
        run = self.running.pop(uid)
        self.engine.abort(uid)
        run.end_span(reason)
        log.info("uid=%s dropped: %s", uid, reason)
        if reason == EndReason.TAKEN_OVER:  # the entry and the reply are the peer's now
            return []
        effects: list[Effect] = []
        if reason == EndReason.TIMEOUT:
            effects.append(Fail(uid, deadline_error()))
        elif reason != EndReason.STOP:  # a stop string already ended the reply in the detokenizer
            # the tokens made before the abort first, so the abort lands where the client stands
            effects += [RecordAbort(uid, reason), Publish([run.delta(o) for o in unsent] + run.abort_deltas(), step)]
        return [*effects, Ack([run.entry_id])]

    def hand_back(self) -> None:
        """On close: every request still running goes back to the group (a peer resumes it under the same
        trace)."""
        for run in self.running.values():
            run.end_span(EndReason.HANDED_BACK)


def stop_span(stops: list[str]) -> int:
    """The most completion tokens one of these stop strings can span, and so the detokenizer's held-back text:
    its UTF-8 bytes, since every token decodes to at least one byte (byte-level BPE and byte-fallback
    vocabularies have a token for every byte, so no bound below the byte count holds for every way the model
    may spell it). Computed once per request."""
    return max((len(s.encode()) for s in stops), default=0)


def merge_outputs(a: StepOutput, b: StepOutput) -> StepOutput:
    """One choice's outputs of consecutive steps as one: b's tokens (and logprobs) after a's."""
    def joined(x: list | None, y: list | None) -> list | None:
        return None if x is None and y is None else (x or []) + (y or [])

    # Built from a's fields, not with dataclasses.replace: a held choice is merged on most steps at GPU step
    # rates, and replace costs several times as much (it walks the fields' definitions on every call).
    return StepOutput(**{**vars(a), "ids": a.ids + b.ids, "finish_reason": b.finish_reason,
                         "logprobs": joined(a.logprobs, b.logprobs),
                         "top_logprobs": joined(a.top_logprobs, b.top_logprobs)})
