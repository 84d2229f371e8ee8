"""vLLM's /tokenize and /detokenize, answered by the model's tokenizer stage."""
