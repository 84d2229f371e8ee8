"""The words a request's life is told in, for every process: the statuses of its record, the finish reasons of
its choices, and why it ended early (docs/design.md, "Request record").

They are `StrEnum`s: each member is the very string that goes to Redis and into messages (`Status.RUNNING ==
"running"`), so what `redis-cli` and the other stages read is unchanged, and a string read back compares equal to
its member.
"""

from __future__ import annotations

from enum import StrEnum


class Status(StrEnum):
    """The request record's `status`: where the request is. The last three are ends."""

    QUEUED = "queued"  # the API wrote the record and the tokenize job
    TOKENIZED = "tokenized"  # a tokenizer forwarded it to the schedulers
    RUNNING = "running"  # a scheduler admitted it (the record names which, and its entry)
    FINISHED = "finished"  # every choice ended with stop or length
    ABORTED = "aborted"
    FAILED = "failed"


TERMINAL = frozenset({Status.FINISHED, Status.ABORTED, Status.FAILED})
NOT_SCHEDULED = frozenset({Status.QUEUED, Status.TOKENIZED})  # no scheduler has admitted it yet


class Finish(StrEnum):
    """A choice's finish reason between the stages (shared/messages.py `TokenDelta.finish`,
    `ReplyEvent.finish_reason`); the API shows OpenAI's (services/api/answer/formats.py adds `tool_calls`)."""

    STOP = "stop"  # an end-of-sequence token, a stop token or a stop string
    LENGTH = "length"  # max_tokens, or the context
    ABORT = "abort"  # aborted: the reply ends where the client stands
    ERROR = "error"  # the engine failed it (an error reply follows)


_STATUS_AFTER: dict[str, Status] = {Finish.STOP: Status.FINISHED, Finish.LENGTH: Status.FINISHED,
                                    Finish.ABORT: Status.ABORTED, Finish.ERROR: Status.FAILED}


def status_after(finish: str) -> Status:
    """The record's status once a choice ended with `finish` (a reason not known here counts as finished)."""
    return _STATUS_AFTER.get(finish, Status.FINISHED)


class EndReason(StrEnum):
    """Why a request ended before its reply did: the API's end reason (logs, metrics), the value of its abort flag
    and notification (`rsinfer:abort:{<uid>}`, where an operator may also SET a reason of their own), and why a
    scheduler stopped running it (its span's outcome)."""

    # the API ended it
    CLIENT_GONE = "client_disconnected"  # its client left (a stream: and none reattached within the window)
    SLOW_CLIENT = "slow_client"  # its client read too slowly
    SERVER_SHUTDOWN = "server_shutdown"
    BROKER_UNAVAILABLE = "broker_unavailable"  # Redis unreachable past --broker-outage-s
    RESPONSE_TOO_LARGE = "response_too_large"  # a non-stream answer passed --max-response-bytes
    SLO_MISSED = "slo_missed"  # no first token by its time-to-first-token target (services/api/answer/slo.py)
    TIMEOUT = "timeout"  # its deadline passed (the API, or a scheduler)
    REJECTED = "rejected"  # a stage refused it (a 4xx error reply)
    FAILED = "failed"  # a stage failed it (a 5xx error reply)
    # someone else set its abort flag
    API = "api"  # DELETE /v1/requests/{uid}
    STOP = "stop"  # a stop string ended its only choice (the detokenizer wrote the reply's end)
    ABORTED = "aborted"  # an abort notification that names no reason
    # a scheduler stopped running it
    TAKEN_OVER = "taken_over"  # a peer took its entry over (the request goes on there)
    RECORD_LOST = "record_lost"  # its record is gone (Redis lost its data)
    OWNER_GONE = "owner_gone"  # the API process that submitted it is gone (and it is not a background request)
    NOT_ADMITTED = "not_admitted"  # Redis refused the pipeline that admits it: admitted again later
    HANDED_BACK = "handed_back"  # shutdown: a peer resumes it


STAGE_ENDED = frozenset({EndReason.REJECTED, EndReason.FAILED})  # a stage already ended it with an error
# Ends that leave a background request running (only DELETE, an abort flag, its deadline or an error end it)
LEFT_RUNNING = frozenset({EndReason.CLIENT_GONE, EndReason.SLOW_CLIENT, EndReason.SERVER_SHUTDOWN,
                          EndReason.BROKER_UNAVAILABLE})
