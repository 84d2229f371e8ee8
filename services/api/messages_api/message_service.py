"""The Messages API's routes' work (services/api/edge/routes.py `add_message_routes` parses and calls it).

`POST /v1/messages` is a chat request through the answer path (services/api/answer/service.py `answer`:
admission, the request, its format, SSE): limits, tenants and quotas, abort on disconnect, deadlines, metrics and
traces hold as for chat, and a stream can be read again from any API process (GET /v1/requests/{id}/stream with
Last-Event-ID, `message_format_of_record`). `POST /v1/messages/count_tokens` asks the model's tokenizer stage
(services/api/tokenize_api/tokenization.py `ask`), admitted as a tokenizer query is, with the chat messages,
tools and template switches the message would be submitted with: its count is the message's prompt.
"""

from __future__ import annotations

import time

from fastapi import Request as HttpRequest

from services.api import errors
from services.api.answer.collaborators import ApiContext
from services.api.answer.limits import too_large
from services.api.answer.service import ApiService
from services.api.messages_api.message_schemas import CountTokensRequest, MessagesRequest
from services.api.tokenize_api import tokenization
from shared.messages import TokenizerQuery


class Messages:
    def __init__(self, ctx: ApiContext, service: ApiService):
        self.ctx, self.service = ctx, service

    async def create(self, http: HttpRequest, body: MessagesRequest):
        return await self.service.answer(http, body)

    async def count_tokens(self, http: HttpRequest, body: CountTokensRequest) -> dict | None:
        """`{"input_tokens": N}`: the prompt the same messages.create would submit, tokenized by its model's
        tokenizer stage; within --max-tokenize-messages and --max-tokenize-chars as /tokenize is."""
        ctx, s = self.ctx, self.ctx.settings
        messages = body.chat_messages()
        if len(messages) > s.max_tokenize_messages:
            raise too_large("messages", f"{len(messages)} messages; at most {s.max_tokenize_messages} "
                            "(--max-tokenize-messages)")
        chars = sum(len(m.content) for m in messages)
        if chars > s.max_tokenize_chars:
            raise too_large("messages", f"the text to count is {chars} characters; at most {s.max_tokenize_chars} "
                            "(--max-tokenize-chars)")
        tools = body.tool_dicts()
        ctx.limits.chat_fields(tools, None)
        tenant = ctx.tenancy.tenant_of(http)
        async with self.service.admission.admit_query(tenant, body.model) as model:
            body.answer_parsing(ctx.stages.snapshot.model_info(model))  # thinking refused as messages.create does
            now = time.time()
            query = TokenizerQuery(uid=ctx.hub.new_uid(), model=model, pod=ctx.pod, created_at=now,
                                   deadline=now + s.request_timeout_s, op="tokenize", messages=messages, tools=tools,
                                   chat_template_kwargs=body.template_kwargs())
            http.scope[errors.UID] = query.uid
            answer = await tokenization.ask(ctx, http, query, ctx.tenancy.record_fields(tenant))
        return None if answer is None else {"input_tokens": answer["count"]}
