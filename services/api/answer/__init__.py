"""The answer path: the one way every generating request goes (service.py: admission → request → formats → sse),
with what it uses (limits, schemas, the reply hub). It imports no feature's API and not the edge."""
