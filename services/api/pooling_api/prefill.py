"""Prefill-only requests at the HTTP edge: `POST /v1/embeddings` (OpenAI's CreateEmbeddingRequest) and
`POST /v1/score` (SGLang's ScoringRequest). Each input (an embedding's, or a score's query with one item) is one
request through the tokenizer and a scheduler, like one prompt of a completion (services/api/answer/request/group.py
RequestGroup); the engine answers it after its prefill (shared/messages.py Pooling) straight into its reply
stream, with no detokenize step. The bodies check every field against the server's limits
(shared/settings.py ApiSettings `max_pooling_*`, `max_score_labels`) and what the schedulers report of the model
(its vocabulary, its embedding size), and answer once every input is done, never streamed."""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

import msgspec
import numpy as np
from pydantic import BaseModel, Field, PrivateAttr, model_validator

from services.api.answer.formats import Counts, Format, Head
from services.api.answer.schemas.field_checks import FORBID, TOKEN_PROMPTS, BadRequest, one_of
from services.api.answer.schemas.submission import Budget, Stamp, Submission, submission
from services.api.errors import ApiError
from shared.messages import Pooling, ReplyEvent, SamplingParams

if TYPE_CHECKING:
    from services.api.answer.limits import Limits

Prompt = tuple[str | None, list[int] | None]  # as text, or as token ids


def check_ids(ids: list[int], param: str, most: int) -> list[int]:
    if not ids:
        raise BadRequest(f"`{param}` has an empty list of token ids", param)
    if len(ids) > most:
        raise BadRequest(f"an input of `{param}` is {len(ids)} tokens; at most {most} (--max-pooling-input-tokens)",
                         param)
    if min(ids) < 0:
        raise BadRequest(f"`{param}` has a negative token id", param)
    return ids


class PrefillBody(BaseModel):
    """What both bodies share: each input is one job; the answer is one JSON body."""

    model_config = FORBID
    kind: ClassVar[str] = ""  # the record's, the metrics' label, and the response id's prefix
    _prompts: list[Prompt] = PrivateAttr(default_factory=list)
    _chosen: tuple = PrivateAttr(default=("last", True))  # what the settings chose of the pooling

    @property
    def lora_path(self) -> None:
        """A LoRA adapter is named as `model` (services/api/lora_api/adapters.py)."""

    def prompts(self, limits: Limits) -> list[Prompt]:
        raise NotImplementedError

    def pooling(self, limits: Limits) -> Pooling:
        raise NotImplementedError

    def check_model(self, info: dict) -> None:
        """Against what the schedulers report of the model (when one has: the engine checks again)."""

    def for_model(self, params: SamplingParams, info: dict) -> SamplingParams:
        """The parameters as the model's defaults make them."""
        return params

    def fmt(self, head: Head, prompts: list[Prompt]) -> Format:
        raise NotImplementedError

    def checked(self, limits: Limits) -> SamplingParams:
        self._prompts = self.prompts(limits)
        limits.record_fields(getattr(self, "user", None))
        return SamplingParams(max_tokens=1, pooling=self.pooling(limits))

    def budget(self, params: SamplingParams) -> Budget:
        assert params.pooling is not None
        return Budget(len(self._prompts), 1, 1, prompts_param=params.pooling.param)

    def submission(self, params: SamplingParams, stamp: Stamp) -> Submission:
        self.check_model(stamp.model_info)
        params = self.for_model(params, stamp.model_info)
        jobs = [stamp.job(None, False, params=params, prompt=text, input_ids=ids) for text, ids in self._prompts]
        head = Head(f"{self.kind}-{jobs[0].uid}", self.model or stamp.model, int(jobs[0].created_at), len(jobs))
        user = getattr(self, "user", None)  # kept in the record, as chat and completions keep it
        return submission(jobs, self.fmt(head, self._prompts), self.kind, False, label=self.kind,
                          annotations={"user": user} if user else None)


class EmbeddingRequest(PrefillBody):
    model: str = Field(min_length=1)
    input: Annotated[str | list[str] | list[int] | list[list[int]], one_of(TOKEN_PROMPTS)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    kind: ClassVar[str] = "embedding"

    def prompts(self, limits: Limits) -> list[Prompt]:
        """One string, a list of strings, one list of token ids or a list of them (OpenAI's `input`)."""
        s, x = limits.s, self.input
        if isinstance(x, str) or (x and all(isinstance(t, int) for t in x)):
            x = [x]  # type: ignore[list-item]
        if not x:
            raise BadRequest("`input` must not be empty", "input")
        if len(x) > s.max_pooling_inputs:
            raise BadRequest(f"`input` has {len(x)} inputs; at most {s.max_pooling_inputs} (--max-pooling-inputs)",
                             "input")
        out: list[Prompt] = []
        for item in x:
            if isinstance(item, str):
                if not item:
                    raise BadRequest("`input` has an empty string", "input")
                out.append((item, None))
            else:
                out.append((None, check_ids(list(item), "input", s.max_pooling_input_tokens)))
        return out

    def pooling(self, limits: Limits) -> Pooling:
        s = limits.s
        self._chosen = (s.embedding_pooling, s.embedding_normalize)
        return Pooling("embed", pooling=s.embedding_pooling, normalize=s.embedding_normalize is not False,
                       dimensions=self.dimensions or 0, max_input_tokens=s.max_pooling_input_tokens, param="input")

    def for_model(self, params: SamplingParams, info: dict) -> SamplingParams:
        """`auto` pooling and an unset normalization as the model says (its sentence-transformers config, reported
        by its schedulers: shared/models.py), else last-token pooling, normalized."""
        pooling, normalize = self._chosen
        if pooling == "auto":
            pooling = info.get("embedding_pooling") or "last"
        if normalize is None:
            normalize = info.get("embedding_normalize", True)
        assert params.pooling is not None
        chosen = msgspec.structs.replace(params.pooling, pooling=pooling, normalize=bool(normalize))
        return msgspec.structs.replace(params, pooling=chosen)

    def check_model(self, info: dict) -> None:
        hidden, allowed = info.get("hidden_size"), info.get("matryoshka_dimensions")
        d = self.dimensions
        if d is None or hidden is None or d == hidden:
            return
        if not allowed:
            raise BadRequest(f"`dimensions` {d}: this model's embeddings have {hidden} dimensions and it does not "
                             "support truncating them (no matryoshka_dimensions in its config)", "dimensions")
        if (allowed is not True and d not in allowed) or not 1 <= d <= hidden:
            raise BadRequest(f"`dimensions` {d} is not one this model allows: "
                             f"{allowed if allowed is not True else f'1 to {hidden}'}", "dimensions")

    def fmt(self, head: Head, prompts: list[Prompt]) -> Format:
        return EmbeddingFormat(head, self.encoding_format)


class ScoreRequest(PrefillBody):
    """SGLang's /v1/score: the probability of each of `label_token_ids` as the next token after the query and
    each item (text joined as text, token ids as ids; the item first with `item_first`)."""

    model: str | None = None
    query: Annotated[str | list[int] | None, one_of("a string or a list of token ids")] = None
    items: Annotated[str | list[str] | list[list[int]] | None, one_of(
        "a string, a list of strings or a list of lists of token ids")] = None
    label_token_ids: list[int] | None = None
    apply_softmax: bool = False
    item_first: bool = False
    kind: ClassVar[str] = "score"

    @model_validator(mode="after")
    def _labels(self) -> ScoreRequest:
        if not self.label_token_ids:
            raise BadRequest("label_token_ids must be provided (at least one token id)", "label_token_ids")
        if min(self.label_token_ids) < 0:
            raise BadRequest("label_token_ids must contain nonnegative integers", "label_token_ids")
        if self.items is None or (isinstance(self.items, list) and not self.items):
            raise BadRequest("items must be provided (at least one)", "items")
        return self

    def prompts(self, limits: Limits) -> list[Prompt]:
        s = limits.s
        items = [self.items] if isinstance(self.items, str) else list(self.items or [])
        if len(items) > s.max_pooling_inputs:
            raise BadRequest(f"`items` has {len(items)} items; at most {s.max_pooling_inputs} (--max-pooling-inputs)",
                             "items")
        if len(self.label_token_ids or []) > s.max_score_labels:
            raise BadRequest(f"{len(self.label_token_ids or [])} label_token_ids; at most {s.max_score_labels} "
                             "(--max-score-labels)", "label_token_ids")
        texts = all(isinstance(i, str) for i in items)
        query = self.query if self.query is not None else ("" if texts else [])
        if texts != isinstance(query, str):
            raise BadRequest("`query` and `items` must both be text or both be token ids", "items")
        pairs = [(i, query) if self.item_first else (query, i) for i in items]
        if texts:
            return [(a + b, None) for a, b in pairs]  # type: ignore[operator]
        return [(None, check_ids([*a, *b], "items", s.max_pooling_input_tokens)) for a, b in pairs]  # type: ignore[misc]

    def pooling(self, limits: Limits) -> Pooling:
        return Pooling("score", label_token_ids=list(self.label_token_ids or []), apply_softmax=self.apply_softmax,
                       max_input_tokens=limits.s.max_pooling_input_tokens, param="items")

    def check_model(self, info: dict) -> None:
        vocab = info.get("vocab_size")
        bad = [t for t in self.label_token_ids or [] if vocab is not None and t >= vocab]
        if bad:
            raise BadRequest(f"Token ID {bad[0]} in `label_token_ids` is out of vocabulary (vocab size: {vocab})",
                             "label_token_ids")

    def fmt(self, head: Head, prompts: list[Prompt]) -> Format:
        return ScoreFormat(head)


class PrefillFormat(Format):
    """The answer of prefill-only requests: each input's one event (its `embedding` or `scores`), by index."""

    def __init__(self, head: Head):
        super().__init__(head)
        self.results: list[ReplyEvent | None] = [None] * head.n

    def add(self, events: list[ReplyEvent]) -> None:
        for ev in events:
            if ev.embedding is not None or ev.scores is not None:
                self.results[ev.index] = ev

    def done(self) -> list[ReplyEvent]:
        if any(r is None for r in self.results):  # its request was aborted (an operator, DELETE) before its prefill
            raise ApiError(500, "the request was aborted before every input was computed", code="request_aborted")
        return self.results  # type: ignore[return-value]

    def _usage(self, c: Counts) -> dict:
        return {"prompt_tokens": c.prompt_tokens, "total_tokens": c.prompt_tokens}


class EmbeddingFormat(PrefillFormat):
    def __init__(self, head: Head, encoding: str):
        super().__init__(head)
        self.encoding = encoding

    def record_fields(self) -> dict:
        return {**super().record_fields(), "encoding_format": self.encoding}

    def response(self, counts: Counts) -> dict:
        data = [{"object": "embedding", "index": i, "embedding": self._vector(ev.embedding or "")}
                for i, ev in enumerate(self.done())]
        return {"object": "list", "data": data, "model": self.model, "usage": self._usage(counts)}

    def _vector(self, b64: str) -> Any:
        """The engine's little-endian float32, as floats or as they are (OpenAI's base64 is that encoding)."""
        if self.encoding == "base64":
            return b64
        return np.frombuffer(base64.b64decode(b64), dtype="<f4").tolist()


class ScoreFormat(PrefillFormat):
    def response(self, counts: Counts) -> dict:
        usage = {"prompt_tokens": counts.prompt_tokens, "completion_tokens": 0, "total_tokens": counts.prompt_tokens}
        return {"scores": [list(ev.scores or []) for ev in self.done()], "model": self.model, "usage": usage,
                "object": "scoring"}
