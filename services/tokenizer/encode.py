"""Prompt -> token ids, batched: chat template for messages, plain encoding for text prompts.

A job the model cannot serve (empty prompt, prompt plus max_tokens past the context, a template error,
token ids outside the vocabulary) becomes a ReplyError with HTTP status 400, never a silent drop.
"""

from __future__ import annotations

import msgspec

from services.tokenizer import tools
from shared.context_limits import LengthError, completion_limit
from shared.grammars import check
from shared.messages import Pooling, ReplyError, SamplingParams, ScheduleJob, TokenizeJob

# Fill-in-the-middle markers: Qwen2.5-Coder's, then StarCoder's.
FIM_TOKENS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"))
DEFAULT_PROMPT = "<|endoftext|>"  # OpenAI's, for `"prompt": null`
# Normalizers that may shorten text before it is split into tokens (compatibility forms, stripped accents or
# spaces): with one, a prompt's bytes bound its tokens less tightly, so the byte bound below is widened.
SHRINKING_NORMALIZERS = ("NFKC", "NFKD", "Strip", "StripAccents", "BertNormalizer", "Precompiled")


def invalid(message: str, param: str | None = None, code: str | None = None) -> ReplyError:
    return ReplyError(message=message, status=400, type="invalid_request_error", param=param, code=code)


class PromptEncoder:
    def __init__(self, tokenizer, max_context: int, tool_call_parser: str = "auto", reasoning_parser: str = "auto",
                 default_max_tokens: int | None = None):
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.default_max_tokens = default_max_tokens  # a request without max_tokens: None = up to the context
        self.vocab_size = len(tokenizer)
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
        self.tool_parser = tools.tool_parser_for(template, tool_call_parser)
        self.reasoning_parser = tools.reasoning_parser_for(template, reasoning_parser)
        vocab = tokenizer.get_vocab()
        self.max_prompt_bytes = max_context * self._bytes_per_token_bound(vocab)
        self.fim = next((names for names in FIM_TOKENS if all(t in vocab for t in names)), None)
        # OpenAI's default prompt, `<|endoftext|>` (a document's start for GPT vocabularies), else this tokenizer's
        # own start (bos) or end (eos) of a document: the text of one special token, encoded as it is.
        self.default_prompt = next((t for t in (DEFAULT_PROMPT, tokenizer.bos_token, tokenizer.eos_token)
                                    if t and t in vocab), "")
        self.call_tokens = all(len(tokenizer.encode(m, add_special_tokens=False)) == 1
                               for m in (tools.HERMES_OPEN, tools.HERMES_CLOSE))
        self.think_close: list[int] = []
        self.think_open = -1
        if self.reasoning_parser != "none":
            self.think_close = tokenizer.encode(tools.THINK_CLOSE, add_special_tokens=False)
            opening = tokenizer.encode(tools.THINK_OPEN, add_special_tokens=False)
            self.think_open = opening[0] if len(opening) == 1 else -1

    def _bytes_per_token_bound(self, vocab: dict[str, int]) -> int:
        """The most bytes of text one token can stand for: a vocabulary string is at least as long in UTF-8 as
        the bytes it decodes to (byte-level BPE spells each byte as one character, SentencePiece a space as
        `▁`, byte fallback `<0x41>`), so its longest is a bound, computed once. A prompt of more bytes than
        the context times this cannot fit, whatever it tokenizes to."""
        longest = max((len(t.encode()) for t in vocab), default=1)
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        normalizer = repr(getattr(backend, "normalizer", None)) if backend is not None else "unknown"
        if normalizer != "None" and any(n in normalizer for n in (*SHRINKING_NORMALIZERS, "unknown")):
            longest *= 4  # a normalized character may be up to 4 bytes shorter than what the client sent
        return longest

    def too_long(self, text: str, param: str) -> ReplyError | None:
        """A 400 for a prompt whose bytes cannot fit the context, before any time is spent tokenizing it."""
        if len(text) <= self.max_prompt_bytes // 4:  # a character is at most 4 bytes: no need to count
            return None
        size = len(text.encode())
        if size <= self.max_prompt_bytes:
            return None
        return invalid(f"This model's maximum context length is {self.max_context} tokens; a prompt of {size} bytes "
                       f"cannot fit it (a token of this model stands for at most "
                       f"{self.max_prompt_bytes // self.max_context} bytes).", param, "context_length_exceeded")

    @staticmethod
    def job_bytes(job: TokenizeJob) -> int:
        """About how much text a job has to render and tokenize (characters): what makes it slow."""
        size = len(job.prompt or "") + len(job.suffix or "") + len(job.input_ids or ())
        for m in job.messages or ():
            size += len(m.content) + len(m.reasoning_content or "")
        return size

    @property
    def parsers(self) -> dict[str, str]:
        """The formats the API parses this model's answers with (in the heartbeat's model_info)."""
        return {"tool_call_parser": self.tool_parser, "reasoning_parser": self.reasoning_parser}

    def encode(self, jobs: list[TokenizeJob]) -> list[ScheduleJob | ReplyError]:
        """One result per job, in order. Texts are encoded in two batched calls (chat and plain)."""
        results: list[ScheduleJob | ReplyError | None] = [None] * len(jobs)
        texts: dict[bool, dict[int, str]] = {False: {}, True: {}}  # add special tokens? -> job's index -> text
        jobs = list(jobs)
        for i, job in enumerate(jobs):
            jobs[i], ready = self._prepare(job)
            if isinstance(ready, tuple):
                text, special = ready
                texts[special][i] = text
            else:
                results[i] = ready
        for special, batch in texts.items():  # chat (no special tokens: the template has them), then plain
            if batch:
                encoded = self.tokenizer(list(batch.values()), add_special_tokens=special)["input_ids"]
                for i, ids in zip(batch, encoded, strict=True):
                    results[i] = self.fit(jobs[i], list(ids))
        return results  # type: ignore[return-value]

    def _prepare(self, job: TokenizeJob) -> tuple[TokenizeJob, ScheduleJob | ReplyError | tuple[str, bool]]:
        """The job as it is scheduled (with its tool grammar, and its answer's window after thinking), and its
        result already (a refusal, or the job of given token ids) or the text to encode and whether with the
        tokenizer's special tokens."""
        refusal = self._check_tools(job)
        if refusal is None:
            job = tools.with_tool_grammar(job, self.tool_parser, self.call_tokens)
            refusal = self._check_constraint(job)
        if refusal is not None:
            return job, refusal
        if job.input_ids is not None:
            return job, self._from_ids(job, job.input_ids)
        if job.messages is not None:
            rendered = self.render_chat(job)
            if isinstance(rendered, ReplyError):
                return job, rendered
            if (refused := self.too_long(rendered, "messages")) is not None:
                return job, refused
            return self._answer_after_thinking(job, rendered), (rendered, False)
        if job.prompt is None and job.suffix is None:  # completions' `"prompt": null`
            return job, (self.default_prompt, False)
        prompt = (job.prompt or "") if job.suffix is None else self._fill_in_the_middle(job)
        if isinstance(prompt, ReplyError):
            return job, prompt
        return job, self.too_long(prompt, "prompt") or (prompt, True)

    def _fill_in_the_middle(self, job: TokenizeJob) -> str | ReplyError:
        """`suffix`: the prompt in the model's fill-in-the-middle layout, if its vocabulary has one."""
        if self.fim is None:
            return invalid("`suffix` needs a fill-in-the-middle template; this model's vocabulary has no FIM "
                           "tokens (<|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>)", "suffix")
        prefix, suffix, middle = self.fim
        return f"{prefix}{job.prompt or ''}{suffix}{job.suffix}{middle}"

    def _check_tools(self, job: TokenizeJob) -> ReplyError | None:
        problem = tools.check_tools(job, self.tool_parser)
        return invalid(problem, "tool_choice") if problem else None

    def _answer_after_thinking(self, job: TokenizeJob, rendered: str) -> TokenizeJob:
        """A reasoning model's response_format or tool grammar starts after its thinking; a regex, JSON
        or grammar extension (`regex`, `json`, `guided_*`) applies to the whole answer, thinking included."""
        guided = job.params.guided
        if guided is None or self.reasoning_parser == "none" or guided.param not in ("response_format",
                                                                                      "tool_choice"):
            return job
        guided = tools.reasoning_window(guided, rendered, self.think_open, self.think_close)
        return msgspec.structs.replace(job, params=msgspec.structs.replace(job.params, guided=guided))

    def _check_constraint(self, job: TokenizeJob) -> ReplyError | None:
        """A schema, regex or grammar the engine could not compile is refused here, naming the field."""
        guided = job.params.guided
        if guided is None:
            return None
        problem = check(guided)
        if problem is None:
            return None
        return invalid(f"`{guided.param or guided.kind}` cannot be used as a constraint: {problem}",
                       guided.param or None, "invalid_constraint")

    def render_chat(self, job: TokenizeJob) -> str | ReplyError:
        try:
            return self.tokenizer.apply_chat_template(
                tools.template_messages(job), tools=job.tools, add_generation_prompt=job.add_generation_prompt,
                continue_final_message=job.continue_final_message, tokenize=False, **job.chat_template_kwargs)
        except TypeError as e:  # a chat_template_kwargs key that is one of the call's own arguments
            return invalid(f"chat_template_kwargs cannot set that: {e}", param="chat_template_kwargs")
        except Exception as e:  # jinja raises its own errors (e.g. roles must alternate)
            return invalid(f"the chat template rejected the messages: {e}", param="messages")

    def _from_ids(self, job: TokenizeJob, ids: list[int]) -> ScheduleJob | ReplyError:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            pooling = job.params.pooling
            return invalid(f"token id {bad} is outside the vocabulary (size {self.vocab_size})",
                           pooling.param if pooling is not None and pooling.param else "prompt")
        return self.fit(job, ids)

    def with_default_budget(self, p: SamplingParams, prompt: int) -> SamplingParams:
        most = self.default_max_tokens
        if p.max_tokens is not None or not most or p.pooling is not None:
            return p
        budget = max(most, p.min_tokens)
        return msgspec.structs.replace(p, max_tokens=budget) if prompt + budget < self.max_context else p

    def _pooled_too_long(self, p: Pooling, tokens: int) -> ReplyError | None:
        """A prefill-only prompt (an embedding's input, a score's item) past its own limit or the context."""
        most = self.max_context - 1
        why = f"the model's context is {self.max_context} tokens"
        if p.max_input_tokens and p.max_input_tokens < most:
            most, why = p.max_input_tokens, "--max-pooling-input-tokens"
        if tokens <= most:
            return None
        param = p.param or "input"
        return invalid(f"an input of `{param}` is {tokens} tokens; at most {most} ({why})", param,
                       "context_length_exceeded")

    def fit(self, job: TokenizeJob, ids: list[int]) -> ScheduleJob | ReplyError:
        """Refuse a request that cannot fit the context. An omitted max_tokens becomes the model's default
        (`default_max_tokens`) where that leaves room in the context; otherwise it stays None: up to the context,
        and only the engine knows how much of that its KV cache can hold."""
        p = self.with_default_budget(job.params, len(ids))
        if not ids:
            return invalid("the prompt is empty after tokenization", "prompt")
        if p.pooling is not None and (too_long := self._pooled_too_long(p.pooling, len(ids))) is not None:
            return too_long
        try:
            completion_limit(len(ids), p.max_tokens, p.min_tokens, self.max_context)
        except LengthError as e:
            return invalid(str(e), e.param or "messages", e.code)
        bad_bias = next((t for t in p.logit_bias if t >= self.vocab_size), None)
        if bad_bias is not None:
            return invalid(f"logit_bias names token {bad_bias}, outside the vocabulary (size {self.vocab_size})",
                           "logit_bias")
        return ScheduleJob(uid=job.uid, model=job.model, pod=job.pod, created_at=job.created_at,
                           deadline=job.deadline, params=p, input_ids=ids, background=job.background,
                           priority=job.priority, trace=job.trace, adapter=job.adapter, tenant=job.tenant,
                           weight=job.weight, cache_salt=job.cache_salt, slo_ttft_ms=job.slo_ttft_ms,
                           slo_tpot_ms=job.slo_tpot_ms)
