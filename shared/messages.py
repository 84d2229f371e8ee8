"""Every message that travels between processes, as frozen msgspec structs.

Each stream entry holds one field, `data`, whose value is the JSON of one of the tagged structs below
(`kind` names it, `v` is its version), so `redis-cli XRANGE` shows it
legibly; no Python object serialization crosses a process.
Decoders ignore fields they do not know, so a newer producer can add optional fields.
"""

from __future__ import annotations

from typing import Any

import msgspec

from shared.request_states import Finish

VERSION = 1
FINISH_REASONS = tuple(Finish)  # a choice's finish reasons (shared/request_states.py)


class Guided(msgspec.Struct, frozen=True, omit_defaults=True):
    """A constraint on a choice's tokens (structured outputs), enforced by a grammar in the engine.

    `kind`: "json_schema" (`spec` is the schema's JSON), "json_object" (any JSON object), "regex", "ebnf"
    (GBNF or Lark), "lark" (tool calls: built by the tokenizer) or "choice" (a JSON list of strings).
    `after`: token ids that end a reasoning model's thinking (`</think>`): the grammar applies only once the
    completion contains them; with `think` (the token that opens thinking, e.g. `<think>`) the first token
    may also be that one (the model decides whether it thinks), else the answer is constrained from its
    first token. Without `think`, a non-empty `after` means the prompt opened the thinking. `param`: the
    request field it came from, named in errors."""

    kind: str
    spec: str = ""
    after: list[int] = []
    think: int = -1
    param: str = ""


class Pooling(msgspec.Struct, frozen=True, omit_defaults=True):
    """A prefill-only request (`POST /v1/embeddings`, `POST /v1/score`): the engine computes the prompt and ends
    the request after its prefill, with no token sampled and no detokenize step; what it computes goes straight
    into the reply stream (ReplyEvent `embedding` or `scores`).

    `task`: "embed" pools the final hidden states: `pooling` "last" (the last token's) or "mean" (over every
    prompt token; such a prompt is computed whole, not read from the prefix cache), L2-`normalize`d after
    keeping the first `dimensions` (0: all). "score": the probabilities of `label_token_ids` as the next token,
    softmax over those labels' logits with `apply_softmax`, else their probabilities over the whole vocabulary
    (SGLang's /v1/score). A prompt may fill the model's context but for one token (the engine's room for the
    position it scores), and at most `max_input_tokens`."""

    task: str
    pooling: str = "last"
    normalize: bool = True
    dimensions: int = 0
    label_token_ids: list[int] = []
    apply_softmax: bool = False
    max_input_tokens: int = 0  # the tokenizer refuses a longer prompt (0: the model's context alone)
    param: str = ""  # the request field the prompt came from (`input`, `items`), named in errors


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    max_tokens: int | None = None  # None: up to the context, as far as the engine's KV cache can hold
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = no top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    echo: bool = False  # the reply starts with the prompt's text (completions)
    prompt_logprobs: int | None = None  # echo with logprobs: score the prompt's tokens, with this many top
    guided: Guided | None = None
    logit_bias: dict[int, float] = {}  # token id -> added to its logit (OpenAI: -100..100)
    pooling: Pooling | None = None  # a prefill-only request: an embedding or scores, no tokens

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1 or self.top_p <= 0.0


class ChatMessage(msgspec.Struct, frozen=True, omit_defaults=True):
    role: str
    content: str
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, OpenAI's shape
    reasoning_content: str | None = None  # an assistant's earlier reasoning (Qwen3 templates render it)


class ToolChoice(msgspec.Struct, frozen=True, omit_defaults=True):
    """How the answer may use `tools`: "auto" (the model decides), "none", "required" (one call or more),
    "function" (exactly one call of `name`). "required" and "function" are enforced with a grammar."""

    mode: str = "auto"
    name: str | None = None
    parallel: bool = True  # more than one call allowed


class RequestJob(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    """What a request carries on its way to the engine, in a tokenize job and a schedule job alike: whose it is,
    its limits in time and sampling, and how it is admitted. Not a message of its own (no `kind`)."""

    uid: str
    model: str
    pod: str  # the API process that owns it
    created_at: float
    deadline: float
    params: SamplingParams
    background: bool = False  # it outlives its client
    priority: int = 0  # admission order in the engine: lower first
    trace: str | None = None  # W3C traceparent of the request's root span, when its API process traces
    # The LoRA adapter it runs with: a name in the adapter registry (shared/adapter_registry.py); inside a scheduler,
    # the registration it resolved to (`AdapterRecord.identity`). None: the base model.
    adapter: str | None = None
    # Fair queueing (services/tokenizer/fair.py) and the model's queue (shared/queued.py): whose turn it takes and
    # how many jobs a turn of its tenant releases; "" is open mode's one tenant. On a schedule job since v1 too,
    # so that a parked job says whose it is.
    tenant: str = ""
    weight: int = 1
    # Prefix-cache isolation (shared/pages.py `prefix_root`): pages are shared only between jobs of equal salts. The
    # API sets it from the tenant (or its policy's shared salt) and the request's `cache_salt`; "" shares with all.
    cache_salt: str = ""
    # The client's SLO (ms; 0: none): its first token is due `slo_ttft_ms` after `created_at` (`ttft_due`), which
    # orders waiting work earliest deadline first within a fair lane; `slo_tpot_ms` is recorded for goodput.
    slo_ttft_ms: int = 0
    slo_tpot_ms: int = 0
    v: int = VERSION

    @property
    def ttft_due(self) -> float:
        """When its first token is due (unix s), or infinity without a TTFT SLO."""
        return self.created_at + self.slo_ttft_ms / 1000 if self.slo_ttft_ms else float("inf")


class TokenizeJob(RequestJob, frozen=True, tag_field="kind", tag="tokenize", omit_defaults=True, kw_only=True):
    """api -> tokenizer: a new request, as the client sent it."""

    messages: list[ChatMessage] | None = None
    prompt: str | None = None
    input_ids: list[int] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the reply continues the last (assistant) message, unclosed
    tools: list[dict[str, Any]] | None = None  # OpenAI's tool objects, rendered by the chat template
    tool_choice: ToolChoice | None = None
    chat_template_kwargs: dict[str, Any] = {}  # extra variables of the chat template (enable_thinking...)
    suffix: str | None = None  # completions: text after the insertion (fill-in-the-middle)


class ScheduleJob(RequestJob, frozen=True, tag_field="kind", tag="schedule", omit_defaults=True, kw_only=True):
    """tokenizer -> scheduler: a tokenized request that fits the context (max_tokens may still be None)."""

    input_ids: list[int]


class TokenizerQuery(msgspec.Struct, frozen=True, tag_field="kind", tag="query", omit_defaults=True, kw_only=True):
    """api -> tokenizer (on the tokenize stream, beside TokenizeJob): `POST /tokenize` (`op` "tokenize": text as
    the model's tokens, with its chat template for `messages`) or `POST /detokenize` (`op` "detokenize": `tokens`
    as text). The tokenizer answers it on the request's reply stream (a TokenizerAnswer or a ReplyError); it never
    reaches a scheduler. `add_special_tokens` None: the chat route's choice (False for messages, whose template
    has them; True for a prompt), so that `count` is the `usage.prompt_tokens` of the same generation request."""

    uid: str
    model: str
    pod: str
    created_at: float
    deadline: float
    op: str = "tokenize"
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tokens: list[int] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] = {}
    return_token_strs: bool = False
    trace: str | None = None
    v: int = VERSION


class TokenDelta(msgspec.Struct, frozen=True, omit_defaults=True):
    """New tokens of one choice of one request, with what a detokenizer needs to turn them into text
    without any state of its own: the tokens just before them (`context`) and the stop strings. The context
    reaches back into the prompt while the completion is shorter than it: its first len(context) - start
    tokens (if positive) are the prompt's last ones.

    The stop strings travel once per choice, not with every step: `stop` is on a choice's first delta (start 0)
    only, and `stops` on every delta says how many the request has. A detokenizer keeps them by uid; one that
    has not seen them (another replica took the first delta, it restarted, a successor resumed the request)
    reads them from the request record's `stop` field, which the scheduler writes when it admits the request.
    A delta with `stop` and no `stops` (an older scheduler) carries them itself."""

    uid: str
    start: int  # completion-token index of ids[0]
    ids: list[int]
    prompt_tokens: int
    index: int = 0  # choice, for n > 1
    n: int = 1  # choices in the request
    context: list[int] = []
    finish: str | None = None
    stop: list[str] = []  # a choice's first delta only (see above)
    stops: int = 0  # how many stop strings the request has
    skip_special_tokens: bool = True
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # A choice's first delta (start 0) only: prompt tokens the prefix cache held; with echo the prompt's
    # ids, and with echo and logprobs each prompt token's logprob and top alternatives (from the second).
    cached_tokens: int = 0
    prompt_ids: list[int] | None = None
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    epoch: int = 0  # of the scheduler that made these tokens (shared/reply_order.py)
    trace: str | None = None  # the request's traceparent, on a choice's first and last delta when traced


class DetokenizeBatch(msgspec.Struct, frozen=True, tag_field="kind", tag="detokenize", omit_defaults=True):
    """scheduler -> detokenizer: everything one engine step produced."""

    scheduler: str
    step: int
    items: list[TokenDelta]
    v: int = VERSION


class TopLogprob(msgspec.Struct, frozen=True):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(msgspec.Struct, frozen=True):
    token: str
    logprob: float | None  # None only for a prompt's first token (echo)
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ReplyEvent(msgspec.Struct, frozen=True, tag_field="kind", tag="delta", omit_defaults=True):
    """detokenizer -> api (rsinfer:reply:{<uid>}): text for completion tokens [start, end) of one choice."""

    start: int
    end: int
    text: str
    prompt_tokens: int
    index: int = 0
    ids: list[int] = []
    finish_reason: str | None = None
    stop_sequence: str | None = None  # the stop string that ended the choice (finish_reason "stop")
    logprobs: list[TokenLogprob] | None = None
    # A choice's first range only (see TokenDelta): the prompt's text (echo), its tokens' logprobs (the
    # first has none: logprob null), and the prompt tokens read from the prefix cache.
    prompt_text: str | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    cached_tokens: int = 0
    thinking: bool = False  # a choice's first range: the prompt opened `<think>` (its answer starts reasoning)
    epoch: int = 0  # of the scheduler that made these tokens (shared/reply_order.py, fencing)
    # A prefill-only request's one range (SamplingParams.pooling), written by the scheduler (start = end = 0,
    # finish_reason "stop"): the embedding as base64 of little-endian float32 (as OpenAI's base64 encoding), or
    # one probability per label token id.
    embedding: str | None = None
    scores: list[float] | None = None
    v: int = VERSION


class ReplyFence(msgspec.Struct, frozen=True, tag_field="kind", tag="fence", omit_defaults=True):
    """scheduler -> api (rsinfer:reply:{<uid>}): the request was taken over with this epoch; from here on,
    events of older epochs are the taken-over scheduler's and are refused."""

    epoch: int
    scheduler: str = ""
    v: int = VERSION


class ReplyCheckpoint(msgspec.Struct, frozen=True, tag_field="kind", tag="checkpoint", omit_defaults=True):
    """scheduler -> a peer resuming the request (rsinfer:reply:{<uid>}): every token of every choice so far, so
    that resuming never depends on a reply stream that MAXLEN has trimmed. Readers that deliver skip it."""

    epoch: int
    outputs: list[list[int]]
    v: int = VERSION


class ReplyError(msgspec.Struct, frozen=True, tag_field="kind", tag="error", omit_defaults=True):
    """Any stage -> api: the request cannot be served; `status` is the HTTP status it maps to."""

    message: str
    status: int = 500
    type: str = "server_error"
    code: str | None = None
    param: str | None = None
    v: int = VERSION


class TokenizerAnswer(msgspec.Struct, frozen=True, tag_field="kind", tag="tokens", omit_defaults=True):
    """tokenizer -> api (rsinfer:reply:{<uid>}): the answer to a TokenizerQuery. Tokenize: `tokens` (their
    `count`), the model's `max_model_len`, and with return_token_strs each token's vocabulary string;
    detokenize: `prompt`, the text of the tokens."""

    tokens: list[int] = []
    count: int = 0
    max_model_len: int = 0
    token_strs: list[str] | None = None
    prompt: str | None = None
    v: int = VERSION


class AdapterRecord(msgspec.Struct, frozen=True, tag_field="kind", tag="adapter", omit_defaults=True, kw_only=True):
    """A LoRA adapter in the registry (the hash `rsinfer:adapters`, field = its name; shared/adapter_registry.py),
    written by the API (`POST /v1/load_lora_adapter`, `--lora-modules`) or a scheduler (`--lora-modules`): a PEFT
    folder at `path` (one every scheduler can read), or under the prefix `stored` of the object store
    (--storage-url)."""

    name: str  # what clients send as `model`
    base: str  # the served model it adapts
    version: str  # new at each registration: the same name loaded again may be other weights
    path: str = ""
    stored: str = ""
    rank: int = 0  # as checked at registration (0: not checked)
    targets: list[str] = []  # the projections it targets, as checked
    created_at: float = 0.0
    v: int = VERSION

    @property
    def identity(self) -> str:
        """The name the engine knows it by: one registration, one set of weights (its prefix-cache pages, its
        slot), so a name unloaded and loaded again is never served the KV or weights of the one before."""
        return f"{self.name}@{self.version}"


Reply = ReplyEvent | ReplyError | ReplyFence | ReplyCheckpoint


class BatchWork(msgspec.Struct, frozen=True, tag_field="kind", tag="batch", omit_defaults=True):
    """api -> every api's batch runner (rsinfer:batch-work): a batch to run (services/api/batch_api/batches.py)."""

    batch_id: str
    v: int = VERSION

_encoder = msgspec.json.Encoder()
_decoders: dict[object, msgspec.json.Decoder] = {}


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes | str, typ: object) -> object:
    """Decode JSON into `typ` (a struct or a union of tagged structs); raises msgspec.DecodeError."""
    dec = _decoders.get(typ)
    if dec is None:
        dec = _decoders[typ] = msgspec.json.Decoder(typ)
    return dec.decode(data)
