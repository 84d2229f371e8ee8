"""A request this API process answers, one object from the moment it is opened to its close
(services/api/answer/service.py answers it; `ApiRequest`, services/api/answer/request/api_request.py, is what the
service needs of one):

- `Requests.open` (requests.py) submits a body's jobs: per job the record, the tokenize job and its inbox's
  registration in one round trip (`SingleRequest.open`, single.py); a completion's several prompts are one request
  each, answered as one (`RequestGroup`, group.py). `Requests.attach` follows a request submitted by any API
  process (reattach). What the requests of the process share, and which of them are open, is context.py's.
- `replies()` yields its reply entries in order, in batches of what arrived together: shared/reply_order.py's
  OrderedReplies delivers each choice's ranges in token order, each once, and nothing of a scheduler that was
  taken over once its successor's fence is in the stream. A reply that ends before the request finished (an
  error reply, the deadline, Redis gone) is raised as `EndedEarly`, the HTTP error, with why it ended noted in
  `end_reason`. The first batch with tokens is the request's time to first token (metrics, span).
- `close(reason)` ends it exactly once whatever happens; whether it is then aborted everywhere is decided in one
  place, the close policy of services/api/answer/request/single.py. Its early ends as HTTP errors: early_end.py.
"""
