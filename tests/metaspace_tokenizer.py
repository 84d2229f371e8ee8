"""A SentencePiece-style tokenizer made locally (no download), shaped like Llama-2's and Mistral's: a
Metaspace pre-tokenizer and decoder, so a word's piece carries its leading space as "▁" and decoding drops
that space on the first piece of what it decodes; "<s>" is prepended to every encoded text, and chats are
wrapped in Mistral's [INST] ... [/INST] control tokens."""

from __future__ import annotations

WORDS = ["Hello", "world", "there"]
SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
                 "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")


def metaspace_tokenizer(vocab_size: int = 64):
    """A PreTrainedTokenizerFast of exactly `vocab_size` ids; apart from the specials, "!" and "▁", every
    piece is a word with its leading space, so any id a random model emits starts a new word."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    pieces = SPECIALS + [f"▁{w}" for w in WORDS] + ["!", "▁"]
    pieces += [f"▁w{i}" for i in range(vocab_size - len(pieces))]
    tok = Tokenizer(models.Unigram([(p, 0.0 if p in SPECIALS else -1.0) for p in pieces], unk_id=0))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   additional_special_tokens=SPECIALS[3:])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def completion_reference(tok, prompt: list[int], completion: list[int], skip_special_tokens: bool = True) -> str:
    """The completion's text as a reference server shows it: decode(prompt + completion) minus decode(prompt),
    from where the two first differ."""
    whole = tok.decode(prompt + completion, skip_special_tokens=skip_special_tokens,
                       clean_up_tokenization_spaces=False)
    head = tok.decode(prompt, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
    cut = 0
    while cut < min(len(head), len(whole)) and head[cut] == whole[cut]:
        cut += 1
    return whole[cut:]
