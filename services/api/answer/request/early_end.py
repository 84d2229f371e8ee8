"""A request's replies ending before it finished (a stage's error reply, its deadline, the reply stream
unreadable): the HTTP error its client gets, and the end reason it is closed with."""

from __future__ import annotations

from services.api.answer.reply_hub import HubError
from services.api.errors import ApiError, redis_down
from shared.messages import ReplyError
from shared.request_states import EndReason


class EndedEarly(ApiError):
    """The replies ended before the request finished: the HTTP error for its client, and the end `reason`."""

    def __init__(self, reason: str, error: ApiError):
        super().__init__(error.status, error.message, param=error.param, code=error.code, type=error.type,
                         retry_after=error.retry_after)
        self.reason = reason


class StageFailed(Exception):
    """A stage sent an error reply for this request."""

    def __init__(self, error: ReplyError):
        super().__init__(error.message)
        self.error = error


class DeadlineExceeded(Exception):
    pass


class SloMissed(Exception):
    """No first token by the request's time-to-first-token target and the tolerance (services/api/answer/slo.py)."""


def ended_early(e: StageFailed | DeadlineExceeded | SloMissed | HubError) -> EndedEarly:
    if isinstance(e, StageFailed):
        # A stage's deadline error is the same end as our own deadline; other errors the stage already ended.
        err = e.error
        reason = (EndReason.TIMEOUT if err.code == "request_timeout" else
                  EndReason.REJECTED if 400 <= err.status < 500 else EndReason.FAILED)
        return EndedEarly(reason, ApiError(err.status, err.message, type=err.type, param=err.param, code=err.code))
    if isinstance(e, DeadlineExceeded):
        return EndedEarly(EndReason.TIMEOUT, ApiError(504, "the request did not finish before its deadline",
                                                      code="request_timeout"))
    if isinstance(e, SloMissed):
        return EndedEarly(EndReason.SLO_MISSED, ApiError(
            503, "the request got no first token within its time-to-first-token target (and --slo-tolerance-ms) and "
            "was ended rather than served late; retry later or with a longer target", code="slo_missed",
            retry_after=1))
    return EndedEarly(EndReason.BROKER_UNAVAILABLE, redis_down())
