"""What a body gives admission (services/api/answer/admission.py): what it asks the engines for (`Budget`), and what
it submits (`Submission`) once the server stamped it (`Stamp`); and what its `checked` asks of the server's limits
(`FieldLimits`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from services.api.answer.formats import Format
from services.api.answer.slo import Slo
from shared.messages import SamplingParams, TokenizeJob


class FieldLimits(Protocol):
    """What a request body's `checked` asks of the server's limits (services/api/answer/limits.py's Limits): the
    schemas stay below the limits, which build on them."""

    def record_fields(self, user: str | None, safety_identifier: str | None = None,
                      metadata: dict[str, str] | None = None) -> None: ...

    def sampling(self, params: SamplingParams, prefix: str = "") -> None: ...

    def chat_fields(self, tools: list[dict] | None, chat_template_kwargs: dict | None) -> None: ...


@dataclass(frozen=True)
class Budget:
    """What one request asks the engines for, in sequences, completion tokens and logprob entries.

    `max_tokens` None (omitted) counts as the model's whole context per sequence, the most it can run; while
    the context is unknown (no worker of the model has declared it yet) it counts as the whole token budget,
    so a single sequence is always taken and several need a `max_tokens`. A `max_tokens` past the context
    counts as the context: the tokenizer refuses it with the context error, the clearer one.
    `prompt_tokens`: an upper bound of each prompt's tokens, counted for logprobs when the prompt is echoed
    with them (its UTF-8 bytes: every token is at least one byte; or its token ids)."""

    prompts: int
    choices: int  # per prompt: best_of, or n
    max_tokens: int | None
    logprobs: int | None = None  # top logprobs per token when logprobs are returned, else None
    echo_prompt_tokens: tuple[int, ...] = ()  # per prompt, when an echoed prompt's logprobs are returned
    tokens_param: str = "max_tokens"
    choices_param: str = "n"
    prompts_param: str = "prompt"  # the field the prompts come from (`input`, `items` in prefill-only requests)
    logprobs_param: str = "logprobs"


@dataclass(frozen=True)
class Stamp:
    """What the server adds to the jobs of a body it takes for `model`: its identity, uids its reply hub reads
    (services/api/answer/reply_hub.py `new_uid`), the cap on the deadline, and what the stages report of the model."""

    model: str
    pod: str
    timeout_s: float  # --request-timeout-s: the longest a request lives, whatever its `timeout`
    new_uid: Callable[[], str]
    model_info: dict
    adapter: str | None = None  # the LoRA adapter the request names (services/api/lora_api/adapters.py)
    cache_salt: str = ""  # its prefix-cache scope (shared/pages.py `isolation_salt`)
    slo: Slo | None = None  # its latency targets (services/api/answer/slo.py), if any

    def job(self, timeout: float | None, background: bool | None, **fields: Any) -> TokenizeJob:
        now, slo = time.time(), self.slo
        return TokenizeJob(uid=self.new_uid(), model=self.model, pod=self.pod, created_at=now,
                           deadline=now + (min(timeout, self.timeout_s) if timeout else self.timeout_s),
                           background=bool(background), adapter=self.adapter, cache_salt=self.cache_salt,
                           slo_ttft_ms=slo.ttft_ms if slo else 0, slo_tpot_ms=slo.tpot_ms if slo else 0, **fields)


@dataclass(frozen=True)
class Submission:
    """What a body submits: its jobs (one per prompt), the format of its answer, and the fields of its record
    that say how it is answered (services/api/answer/request/single.py writes them with each job)."""

    jobs: list[TokenizeJob]
    fmt: Format
    record: dict
    stream: bool
    label: str  # how it is answered, in the metrics: stream, full, generate
    # What the request stores beside its record (a stored response, services/api/responses_api/responses.py): queued on
    # the pipeline that opens it (services/api/answer/request/single.py), in the same transaction, so nothing is stored
    # for a request that was not opened.
    writes: Callable[[Any], None] | None = None


def submission(jobs: list[TokenizeJob], fmt: Format, kind: str, stream: bool | None, *, label: str | None = None,
               annotations: dict[str, str] | None = None) -> Submission:
    """`kind`: the record's (chat, completion, generate); `annotations`: what the client tells about itself, and
    what a reattach needs besides the format's fields; `label` by default says stream or full."""
    record = {"kind": kind, "n": jobs[0].params.n, **fmt.record_fields(), **(annotations or {})}
    if jobs[0].adapter:  # the LoRA adapter the client named as `model` (a reattached stream says it too)
        record["adapter"] = jobs[0].adapter
    return Submission(jobs, fmt, record, bool(stream), label or ("stream" if stream else "full"))
