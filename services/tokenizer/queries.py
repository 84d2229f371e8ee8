"""`POST /tokenize` and `POST /detokenize`, answered by the tokenizer stage (pure code: a query in, its answer
out). A query is rendered and encoded exactly as a generation request of the same messages or prompt is
(services/tokenizer/encode.py), so its `count` is that request's `usage.prompt_tokens`; unlike one, it is not
bounded by the context (counting is what a client asks it for), only by the API's input limits.
"""

from __future__ import annotations

from services.tokenizer.encode import PromptEncoder, invalid
from shared.messages import ReplyError, SamplingParams, TokenizeJob, TokenizerAnswer, TokenizerQuery

_NO_SAMPLING = SamplingParams()  # a query renders like a job, which samples nothing


def answer(encoder: PromptEncoder, query: TokenizerQuery) -> TokenizerAnswer | ReplyError:
    if query.op == "detokenize":
        return detokenize(encoder, query.tokens or [])
    if query.op != "tokenize":
        return invalid(f"unknown tokenizer query `{query.op}`", "op")
    text = rendered(encoder, query)
    if isinstance(text, ReplyError):
        return text
    chat = query.messages is not None
    special = (not chat) if query.add_special_tokens is None else query.add_special_tokens
    ids = list(encoder.tokenizer(text, add_special_tokens=special)["input_ids"])
    strs = encoder.tokenizer.convert_ids_to_tokens(ids) if query.return_token_strs else None
    return TokenizerAnswer(tokens=ids, count=len(ids), max_model_len=encoder.max_context, token_strs=strs)


def rendered(encoder: PromptEncoder, query: TokenizerQuery) -> str | ReplyError:
    """The text a query's tokens are of: its prompt, or its messages through the chat template (as the chat
    route renders them, tools included)."""
    if query.messages is None:
        return query.prompt or ""
    job = TokenizeJob(uid=query.uid, model=query.model, pod=query.pod, created_at=query.created_at,
                      deadline=query.deadline, params=_NO_SAMPLING, messages=query.messages,
                      add_generation_prompt=query.add_generation_prompt,
                      continue_final_message=query.continue_final_message, tools=query.tools,
                      chat_template_kwargs=query.chat_template_kwargs)
    return encoder.render_chat(job)


def detokenize(encoder: PromptEncoder, tokens: list[int]) -> TokenizerAnswer | ReplyError:
    """The text of `tokens`, special tokens included (as vLLM's /detokenize decodes them)."""
    bad = next((i for i, t in enumerate(tokens) if not 0 <= t < encoder.vocab_size), None)
    if bad is not None:
        return invalid(f"tokens[{bad}] = {tokens[bad]} is outside the vocabulary (size {encoder.vocab_size})",
                       "tokens")
    return TokenizerAnswer(prompt=encoder.tokenizer.decode(tokens, skip_special_tokens=False),
                           max_model_len=encoder.max_context)


def query_chars(query: TokenizerQuery) -> int:
    """About how much text a query has to render, tokenize or decode: what makes it slow."""
    size = len(query.prompt or "") + len(query.tokens or ())
    for m in query.messages or ():
        size += len(m.content) + len(m.reasoning_content or "")
    return size
