"""The prefill-only APIs: `POST /v1/embeddings` and `POST /v1/score`."""
