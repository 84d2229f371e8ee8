"""The fields every generating body shares (`SamplingFields`: OpenAI's sampling fields, vLLM's and SGLang's
extensions, the structured-output constraints), and their translation into SamplingParams."""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.api.answer.schemas.field_checks import (
    FORBID,
    SCHEMA_SHAPES,
    STRINGS,
    BadRequest,
    one_of,
    refuse_unless,
    schema_text,
)
from services.api.answer.slo import MAX_SLO_MS
from services.api.multitenancy.tenants import MAX_CACHE_SALT
from shared.messages import Guided, SamplingParams

MAX_N = 16
MAX_STOP = 16
CacheSalt = Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT)]  # vLLM's `cache_salt`
SloMs = Annotated[int, Field(ge=1, le=MAX_SLO_MS)]


class SloTargets(BaseModel):
    """`slo`: the request's latency targets, in milliseconds (services/api/answer/slo.py; as the `x-slo-*` headers)."""

    model_config = FORBID
    ttft_ms: SloMs | None = None
    tpot_ms: SloMs | None = None


class StreamOptions(BaseModel):
    model_config = FORBID
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: every chunk carries the usage so far
    include_obfuscation: bool | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> StreamOptions:
        refuse_unless(self.include_obfuscation, (None, False), "stream_options.include_obfuscation",
                      "streams are not padded")
        return self


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    model: str = Field(min_length=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None  # 0 is greedy
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = 1
    stop: Annotated[str | list[str] | None, one_of(STRINGS)] = None
    seed: Annotated[int, Field(ge=-(2**63), lt=2**63)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # kept in the request record, as OpenAI keeps it for abuse monitoring
    # Extensions (vLLM / SGLang).
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    ignore_eos: bool | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    timeout: Annotated[float, Field(gt=0)] | None = None
    background: bool | None = False
    priority: int = Field(0, ge=-(2**31), lt=2**31)  # lower first (vLLM's order)
    # Structured outputs (SGLang: regex, json, ebnf; vLLM: guided_*): the answer follows the constraint.
    regex: str | None = None
    json_: Annotated[dict[str, Any] | str | None, one_of(SCHEMA_SHAPES)] = Field(None, alias="json")
    ebnf: str | None = None
    guided_json: Annotated[dict[str, Any] | str | None, one_of(SCHEMA_SHAPES)] = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    lora_path: str | None = None  # SGLang's: the name of the LoRA adapter to run with
    # (services/api/lora_api/adapters.py)
    cache_salt: CacheSalt | None = None  # vLLM's: prefix-cache pages are shared only with the same salt (and tenant)
    slo: SloTargets | None = None  # latency targets (services/api/answer/slo.py)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return v

    def constraints(self) -> list[Guided]:
        """The structured-output fields set, as constraints (at most one may be)."""
        out = []
        for field, kind in (("regex", "regex"), ("json_", "json_schema"), ("ebnf", "ebnf"),
                            ("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_grammar", "ebnf"),
                            ("guided_choice", "choice")):
            value = getattr(self, field)
            if value is None:
                continue
            name = field.rstrip("_")
            if kind == "json_schema":
                value = schema_text(value, name)
            elif kind == "choice":
                if not value:
                    raise BadRequest("guided_choice must list at least one string", name)
                value = json.dumps(value)
            out.append(Guided(kind, value, param=name))
        return out

    def guided(self, extra: tuple[Guided, ...] = ()) -> Guided | None:
        found = [*self.constraints(), *extra]
        if len(found) > 1:
            raise BadRequest("give at most one structured-output constraint; got " +
                             ", ".join(f"`{g.param}`" for g in found), found[1].param)
        return found[0] if found else None

    def sampling(self, max_tokens: int | None, logprobs: bool, top_logprobs: int,
                 guided: Guided | None = None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        values: dict[str, Any] = dict(
            max_tokens=max_tokens, min_tokens=self.min_tokens, temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, seed=self.seed, stop=stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, n=self.n, logprobs=logprobs,
            top_logprobs=top_logprobs, skip_special_tokens=self.skip_special_tokens, guided=guided,
            logit_bias=self.token_bias())
        return SamplingParams(**{k: v for k, v in values.items() if v is not None})

    def token_bias(self) -> dict[int, float] | None:
        """OpenAI's logit_bias: token ids (as JSON object keys) to a bias in [-100, 100]."""
        if not self.logit_bias:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            if not key.lstrip("-").isdigit() or int(key) < 0:
                raise BadRequest(f"logit_bias keys must be token ids; got {key!r}", "logit_bias")
            if not -100 <= bias <= 100:
                raise BadRequest(f"logit_bias values must be in [-100, 100]; got {bias}", "logit_bias")
            out[int(key)] = float(bias)
        return out

    def annotations(self) -> dict[str, str]:
        """What the client tells about itself, kept in the request record."""
        return {"user": self.user} if self.user else {}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.continuous_usage_stats)
