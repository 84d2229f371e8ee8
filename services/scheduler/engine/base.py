"""The scheduler's engine interface: add a request, step the running batch, abort a request.

The scheduler process owns Redis; the engine owns the model, the KV cache and the batch. Calls are
never concurrent: the scheduler adds and aborts only between steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from shared.context_limits import LengthError, completion_limit
from shared.messages import SamplingParams


class RequestRejected(Exception):
    """The engine cannot serve this request (e.g. prompt plus max_tokens past the context). `code` is
    what the client's error says: "context_length_exceeded" for requests too long, else "invalid_request";
    `param` names the request field at fault, if one is."""

    def __init__(self, message: str, code: str = "invalid_request", param: str | None = None):
        super().__init__(message)
        self.code = code
        self.param = param


def allowed_completion(prompt: int, params: SamplingParams, context: int, kv_tokens: int | None = None) -> int:
    """shared/context_limits.py `completion_limit` for an engine: what it refuses, as RequestRejected."""
    try:
        return completion_limit(prompt, params.max_tokens, params.min_tokens, context, kv_tokens)
    except LengthError as e:
        raise RequestRejected(str(e), e.code or "invalid_request", e.param) from None


def refuse_prefill_only(engine: str) -> RequestRejected:
    """What an engine without pooling answers a prefill-only request."""
    return RequestRejected(f"embeddings and scores need the paged engine; this scheduler runs the {engine} engine "
                           "(--engine paged)")


@dataclass
class EngineRequest:
    uid: str
    input_ids: list[int]
    params: SamplingParams  # max_tokens None: up to the context, as far as the engine's KV cache allows
    # Tokens already produced per choice, when a peer resumes a request after a crash.
    output_ids: list[list[int]] = field(default_factory=list)
    priority: int = 0  # admission order among waiting requests: lower first (as vLLM), then arrival
    adapter: str | None = None  # the LoRA adapter the request runs with (its name); None: the base model
    cache_salt: str = ""  # its prefix-cache pages are shared only with requests of the same salt (shared/pages.py)
    ttft_due: float = float("inf")  # when its first token is due (its TTFT SLO): earlier first among equal priorities


@dataclass
class StepOutput:
    """New tokens of one choice of one request in one step; `finish_reason` set on its last output."""

    uid: str
    start: int  # completion-token index of ids[0]
    ids: list[int]
    index: int = 0  # choice
    finish_reason: str | None = None  # "stop" | "length" | "error"
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    error: str | None = None
    error_status: int = 500  # the HTTP status the error maps to: 400 when the request itself is at fault
    error_param: str | None = None  # the request field at fault, if one is
    # On a choice's first output only: prompt tokens read from the prefix cache, and (when asked, echo)
    # the logprob and top alternatives of each prompt token after the first.
    cached_tokens: int = 0
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    # A prefill-only request's one output (shared/messages.py Pooling): its embedding as little-endian float32,
    # or its label tokens' scores.
    embedding: bytes | None = None
    scores: list[float] | None = None


class Engine(Protocol):
    max_context: int  # model context length in tokens
    prefix_page_size: int  # tokens per page of its prefix cache; 0: it has none (and publishes nothing)

    def add(self, req: EngineRequest) -> int:
        """Queue a request and return its max_tokens (an omitted one resolved to what the context and the
        engine's KV cache allow); raises RequestRejected if it can never be served."""

    def abort(self, uid: str, index: int | None = None) -> bool:
        """Drop a request (running or waiting), or only its choice `index` (a stop string ended it), and
        free its KV pages; True if it was known."""

    def step(self) -> list[StepOutput]:
        """Run one batch step (prefill chunks and decodes) and return what it produced."""

    def room(self) -> int:
        """How many more requests the scheduler should pull from its stream now (0 = full)."""

    def has_work(self) -> bool: ...

    def stats(self) -> dict:
        """Counts for heartbeats and metrics: running, waiting, kv_used_tokens, kv_total_tokens..."""

    def prefix_changes(self) -> tuple[list[bytes], list[bytes]]:
        """Digests (shared/pages.py) of the full pages its prefix cache named, and evicted, since the last call;
        called between steps only."""

    def prefix_digests(self) -> list[bytes]:
        """Every digest its prefix cache holds now."""

    def resident_adapters(self) -> list[str]:
        """Names of the LoRA adapters loaded now (a request naming one starts without waiting for a load)."""

    def close(self) -> None: ...
