"""The bodies that complete a prompt: `POST /v1/completions` (OpenAI's CreateCompletionRequest) and SGLang's
native `POST /generate`."""

from __future__ import annotations

from functools import cached_property
from typing import Annotated, Any

import msgspec
from pydantic import BaseModel, Field, model_validator

from services.api.answer.formats import CompletionFormat, GenerateFormat, Head
from services.api.answer.schemas.field_checks import FORBID, TOKEN_PROMPTS, BadRequest, one_of
from services.api.answer.schemas.sampling_fields import MAX_N, CacheSalt, SamplingFields, SloTargets
from services.api.answer.schemas.submission import Budget, FieldLimits, Stamp, Submission, submission
from shared.messages import SamplingParams

MAX_PROMPTS = 64  # prompts in one completion request


class CompletionRequest(SamplingFields):
    # null or omitted: OpenAI's default prompt, `<|endoftext|>` (the tokenizer's bos or eos text without it)
    prompt: Annotated[str | list[int] | list[str] | list[list[int]] | None, one_of(TOKEN_PROMPTS)] = None
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool | None = False
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < (self.n or 1):
            raise BadRequest(f"best_of ({self.best_of}) must be at least n ({self.n or 1})", "best_of")
        if self.stream and self.best_of is not None and self.best_of > (self.n or 1):
            raise BadRequest("best_of above n cannot be streamed (the best choices are known at the end)",
                             "best_of")
        return self

    def checked(self, limits: FieldLimits) -> SamplingParams:
        """The sampling parameters, once every field is within the server's limits (a 400 naming the field)."""
        params = self.params()
        self.prompt_list  # noqa: B018  (the prompts' own 400s come first, as they are read)
        limits.record_fields(self.user)
        limits.sampling(params)
        return params

    def submission(self, params: SamplingParams, stamp: Stamp) -> Submission:
        jobs = [stamp.job(self.timeout, self.background, params=params, prompt=prompt, input_ids=ids,
                          suffix=self.suffix, priority=self.priority) for prompt, ids in self.prompt_list]
        fmt = CompletionFormat(Head(f"cmpl-{jobs[0].uid}", self.model, int(jobs[0].created_at), len(jobs) * params.n,
                                    self.logprobs is not None, self.include_usage), echo=bool(self.echo),
                               best_of=params.n, keep=self.n or 1)
        fmt.continuous_usage = self.continuous_usage
        annotations = {**self.annotations(), **({"echo": "1"} if self.echo else {})}
        return submission(jobs, fmt, "completion", self.stream, annotations=annotations)

    @cached_property
    def prompt_list(self) -> list[tuple[str | None, list[int] | None]]:
        return self.prompts()

    def prompts(self) -> list[tuple[str | None, list[int] | None]]:
        """The request's prompts, each as text or as token ids (OpenAI takes one or a list of either)."""
        p = self.prompt
        if p is None:
            return [(None, None)]  # the tokenizer's default prompt (services/tokenizer/encode.py)
        if isinstance(p, str):
            return [(p, None)]
        if not p:
            raise BadRequest("prompt must not be empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [(None, list(p))]  # type: ignore[arg-type]
        if len(p) > MAX_PROMPTS:
            raise BadRequest(f"at most {MAX_PROMPTS} prompts in one request", "prompt")
        return [(x, None) if isinstance(x, str) else (None, list(x)) for x in p]  # type: ignore[misc]

    @property
    def choices_per_prompt(self) -> int:
        """Choices the engine runs per prompt: best_of of them, of which the best n are returned."""
        return max(self.best_of or 1, self.n or 1)

    def budget(self, params: SamplingParams) -> Budget:
        """Logprobs count only when returned (best_of ranks choices by logprobs the answer leaves out)."""
        prompts = self.prompt_list
        echoed = tuple(len(text.encode()) if text is not None else len(ids) if ids is not None else 1
                       for text, ids in prompts)
        return Budget(len(prompts), params.n, params.max_tokens, self.logprobs,
                      echoed if self.echo and self.logprobs is not None else (),
                      choices_param="best_of" if self.best_of else "n")

    def params(self) -> SamplingParams:
        lp = self.logprobs
        p = self.sampling(self.max_tokens, lp is not None or self.choices_per_prompt > (self.n or 1), lp or 0,
                          self.guided())
        return msgspec.structs.replace(p, n=self.choices_per_prompt, echo=bool(self.echo),
                                       prompt_logprobs=lp if self.echo and lp is not None else None)


class GenerateRequest(BaseModel):
    """SGLang-style native request: text or input_ids, sampling_params, stream, priority."""

    model_config = FORBID
    model: str | None = None
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    priority: int = Field(0, ge=-(2**31), lt=2**31)
    lora_path: str | None = None  # SGLang's: the name of the LoRA adapter to run with
    # (services/api/lora_api/adapters.py)
    cache_salt: CacheSalt | None = None
    slo: SloTargets | None = None

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise BadRequest("give exactly one of text and input_ids", "text")
        return self

    def checked(self, limits: FieldLimits) -> SamplingParams:
        params = self.params()
        limits.sampling(params, "sampling_params.")
        return params

    def submission(self, params: SamplingParams, stamp: Stamp) -> Submission:
        job = stamp.job(None, False, params=params, prompt=self.text, input_ids=self.input_ids,
                        priority=self.priority)
        fmt = GenerateFormat(job.uid, stamp.model, int(job.created_at))
        return submission([job], fmt, "generate", self.stream, label="generate")

    def budget(self, params: SamplingParams) -> Budget:
        return Budget(1, 1, params.max_tokens, tokens_param="sampling_params")

    def params(self) -> SamplingParams:
        sp = dict(self.sampling_params)
        for top in ("priority", "lora_path"):
            if top in sp:
                raise BadRequest(f"`{top}` goes at the top level of the request, not in sampling_params",
                                 "sampling_params")
        if sp.get("n") not in (None, 1):  # one text answers: several choices would run together in it
            raise BadRequest("/generate answers with one text; for several choices use /v1/completions with `n`",
                             "sampling_params.n")
        renames = (("max_new_tokens", "max_tokens"), ("min_new_tokens", "min_tokens"), ("json_schema", "json"))
        for sglang, ours in renames:
            if sglang in sp:
                sp[ours] = sp.pop(sglang)
        sp.setdefault("max_tokens", 128)
        try:
            fields = SamplingFields(model="native", **sp)
        except ValueError as e:
            raise BadRequest(f"bad sampling_params: {e}", "sampling_params") from e
        return fields.sampling(fields.max_tokens, False, 0, fields.guided())
