"""Request bodies at the HTTP edge (pydantic), and their translation into SamplingParams.

Each body builds what it submits (`submission`: its jobs, one per prompt, the format of its answer and what the
request record keeps), given what the server adds (`Stamp`), once its fields passed the server's limits
(`checked`): services/api/answer/schemas/submission.py. The bodies, by endpoint: chat.py (`/v1/chat/completions`),
completions.py (`/v1/completions` and SGLang's `/generate`), the sampling fields they share in
sampling_fields.py, and the refusals and checks every body uses (the Responses API's too) in field_checks.py.

Fields follow OpenAI's CreateChatCompletionRequest / CreateCompletionRequest, plus the extensions vLLM
and SGLang accept (top_k, min_p, ignore_eos, repetition_penalty, min_tokens, stop_token_ids,
skip_special_tokens, add_generation_prompt, continue_final_message), `timeout` (seconds, capped by the
server's --request-timeout-s) and `background`. Every field is honoured or refused with a 400 naming it:
an unknown field is refused as OpenAI refuses it ("Unrecognized request argument supplied"), and a known
field we cannot honour is refused when set to anything but its no-op value.
"""
