"""LoRA adapters: vLLM's load and unload routes, the adapters' cards, their counts on /metrics."""
