"""A few seconds of training for the demo model, so that its answers end as a chat model's do.

Random weights never choose to stop: a free answer runs to `max_tokens`, and a string the JSON grammar opens
runs on until the budget cuts it. So `make_model` trains the tiny checkpoint briefly (a fixed number of steps,
seeded, one CPU thread: the same weights on every run of a machine) on a synthetic corpus of chat turns in the
template's format: short answers that end with `<|im_end|>`, JSON objects with short strings, `<tool_call>`
answers when tools are listed, a short thought and `</think>` first when the template opened `<think>`. The
loss counts only the answers (not the first token of a JSON object or a call: the model learns to finish what
a grammar starts, not to start it unasked). Beside them, the untrained model's own greedy runs (from random
ids and from plain words) keep their text: outside the chat format the model stays as varied as random weights
(tests compare long greedy texts, and stop strings must not be found in a loop of one token).
"""

from __future__ import annotations

import copy
import json
import random
import re
from pathlib import Path
from typing import Any

STEPS = 160
BATCH = 12
LEARNING_RATE = 5e-3
THINKING = 0.35  # of the chat turns: thinking first (after the template's <think>)
PROMPT_TAIL = 16  # prompt tokens kept before an answer: its end is what tells the answer's kind
TOOLS_END = "</tool_call><|im_end|>"  # the end of the system turn that lists tools
NOISE, NOISE_LEN, NOISE_WEIGHT = 4, 48, 4.0  # per batch: greedy runs of the untrained model, kept (`_trajectories`)

CITIES = ["Paris", "Oslo", "Rome", "Lima", "Tokyo", "Berlin", "Cairo", "Madrid", "Lisbon", "Dublin", "Vienna",
          "Prague", "Seoul", "Quito", "Nairobi", "Sydney", "Austin", "Boston", "Denver", "Milan"]
KEYS = ["name", "city", "population", "age", "country", "color", "title", "count", "id", "value", "answer",
        "reason", "days", "tz", "unit", "query", "year", "score", "price", "language", "capital", "summary",
        "label", "type", "status", "topic", "word", "size", "location", "date", "text", "result"]
FUNCTIONS = ["get_weather", "get_time", "search", "lookup", "send_email", "add", "get_stock_price",
             "book_flight", "translate", "calculate", "find_city", "get_news"]
ASKS = ["Hi", "Hello!", "Paris?", "A city", "And then?", "Tell me a story", "What is the weather in {city}?",
        "How are you?", "What time is it in {city}?", "Give me {w} {w}", "Why {w}?", "{w} {w} {w}", "{W} {w}?",
        "Please {w} the {w}.", "Request number {n}: tell me a story", "What is {n} plus {n}?", "{city}?"]


def words(text: str) -> list[str]:
    return sorted({w.lower() for w in re.findall(r"[A-Za-z]{2,10}", text)})


class Corpus:
    """Chat turns in the template's format, drawn from `rng`: (prompt text, the answer's pieces)."""

    def __init__(self, tokenizer, rng: random.Random):
        self.tok, self.rng = tokenizer, rng
        self.vocab = words((Path(__file__).parent / "data" / "corpus.txt").read_text(encoding="utf-8"))

    # -- pieces -------------------------------------------------------------------------------------------
    def word(self) -> str:
        return self.rng.choice(self.vocab)

    def ask(self) -> str:
        r = self.rng
        return re.sub(r"\{(\w+)\}", lambda m: {"w": self.word(), "W": self.word().capitalize(),
                                               "city": r.choice(CITIES), "n": str(r.randint(0, 99))}[m[1]],
                      r.choice(ASKS))

    def sentence(self, most: int = 8) -> str:
        text = " ".join(self.word() for _ in range(self.rng.randint(1, most)))
        return text.capitalize() + self.rng.choice([".", ".", ".", "!", "?"])

    def value(self, key: str) -> Any:
        r = self.rng
        kind = r.random()
        if key in ("name", "city", "capital", "location"):
            return r.choice(CITIES)
        if key in ("population", "age", "count", "days", "year", "score", "size") or kind < 0.2:
            return r.choice([r.randint(0, 9), r.randint(10, 999), r.randint(1000, 9_999_999)])
        if kind < 0.25:
            return r.choice([True, False])
        if kind < 0.3:
            return round(r.uniform(0, 100), r.randint(1, 2))
        if kind < 0.5:
            return r.choice(CITIES)
        return " ".join(self.word() for _ in range(r.randint(1, 2)))

    def json_object(self) -> str:
        keys = self.rng.sample(KEYS, self.rng.choice([1, 1, 2, 2, 3]))
        if self.rng.random() < 0.3:
            keys = ["name", "population"]
        return json.dumps({k: self.value(k) for k in keys}, ensure_ascii=False)

    def tool(self, name: str) -> dict:
        keys = self.rng.sample(KEYS, self.rng.choice([1, 1, 1, 2]))
        props = {k: {"type": "integer" if isinstance(self.value(k), int) else "string"} for k in keys}
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": props, "required": keys}}}

    def call(self, tool: dict) -> str:
        fn = tool["function"]
        args = {k: self.value(k) if spec["type"] == "integer" else self.rng.choice([*CITIES, self.word()])
                for k, spec in fn["parameters"]["properties"].items()}
        return "<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False) + \
            "\n</tool_call>"

    # -- turns --------------------------------------------------------------------------------------------
    def turn(self) -> tuple[str, list[tuple[str, bool]]]:
        """One chat turn: a plain answer, a JSON object, a tool call, or an answer after a tool's result,
        thinking first in some of them (after the `<think>` the template opens then). The answer comes in
        pieces, each with whether it is learnt: the first token of a JSON object or a call is not, so the model
        learns to finish what a grammar (response_format, a required tool) starts, not to start it unasked."""
        r = self.rng
        messages: list[dict] = [{"role": "system", "content": self.sentence()}] if r.random() < 0.15 else []
        if r.random() < 0.2:
            messages += [{"role": "user", "content": self.ask()}, {"role": "assistant", "content": self.sentence()}]
        kind = r.choices(["text", "json", "call", "result"], [30, 35, 20, 15])[0]
        tools = [self.tool(name) for name in r.sample(FUNCTIONS, r.randint(1, 2))] if kind in ("call", "result") \
            else None
        messages.append({"role": "user", "content": self.ask()})
        if kind == "json":
            answer = [("{\"", False), (self.json_object()[2:], True)]
        elif kind == "call":
            answer = [("<tool_call>", False), (self.call(r.choice(tools))[len("<tool_call>"):], True)]  # type: ignore
        else:
            if kind == "result":
                messages += self.call_and_result(r.choice(tools))  # type: ignore[arg-type]
            answer = [(self.sentence(), True)]
        thinking = r.random() < THINKING
        if thinking:  # the template opened <think> in the prompt; thoughts start as Qwen3's and R1's do
            answer.insert(0, ("Okay, " + self.sentence().lower() + "\n</think>\n\n", True))
        prompt = self.tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                              enable_thinking=thinking)
        return prompt, answer

    def call_and_result(self, tool: dict) -> list[dict]:
        call = json.loads(self.call(tool).split("\n")[1])
        return [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
                {"role": "tool", "content": self.rng.choice(["sunny", "42", "ok", self.json_object()])}]


def examples(tokenizer, rng: random.Random, count: int) -> list[tuple[list[int], list[int]]]:
    """`count` (input ids, labels) pairs: a prompt's last tokens, then an answer and the end token, labelled
    where the answer is learnt (-100 elsewhere)."""
    corpus, end = Corpus(tokenizer, rng), tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = []
    for _ in range(count):
        prompt, answer = corpus.turn()
        # the tools' system turn is long: only its last line is kept, so that the model still sees tools listed
        prompt = prompt[prompt.rfind(TOOLS_END):] if TOOLS_END in prompt else prompt
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ids = ids if TOOLS_END in prompt else ids[-PROMPT_TAIL:]
        labels = [-100] * len(ids)
        for text, learnt in answer:
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids, labels = ids + piece, labels + (piece if learnt else [-100] * len(piece))
        out.append(([*ids, end], [*labels, end]))
    return out


def train(model, tokenizer, seed: int, steps: int = STEPS) -> None:
    """Train `model` in place on the corpus (loss on the answers only), deterministically for `seed`. Each batch
    also holds random token sequences labelled with the untrained model's own greedy choices, so that text
    unlike the corpus stays as varied as random weights make it (greedy-equality tests rely on that)."""
    import torch

    rng = random.Random(seed)
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    data = sorted(examples(tokenizer, rng, steps * BATCH), key=lambda pair: len(pair[0]))
    batches = [_batch(data[k:k + BATCH], pad) for k in range(0, len(data), BATCH)]  # alike lengths: little padding
    rng.shuffle(batches)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same sums in the same order on any machine's CPU count
    try:
        noise = _trajectories(model, tokenizer, Corpus(tokenizer, rng), seed, steps)
        teacher = copy.deepcopy(model).eval()
        opt = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95), weight_decay=0.0)
        model.train()
        for step, (ids, labels) in enumerate(batches):
            for group in opt.param_groups:  # a short warm-up, then a linear decay
                group["lr"] = LEARNING_RATE * min(1.0, (step + 1) / 5) * (1 - step / steps)
            # padding is on the right, where causal attention never looks back from a real token
            loss = model(input_ids=ids, labels=labels).loss
            kept = slice(NOISE_LEN // 3 - 1, None)  # where the greedy run goes on, not its prompt (an answer there)
            with torch.no_grad():
                target = torch.log_softmax(teacher(input_ids=noise[step]).logits[:, kept], -1).flatten(0, 1)
            guess = torch.log_softmax(model(input_ids=noise[step]).logits[:, kept], -1).flatten(0, 1)
            loss = loss + NOISE_WEIGHT * torch.nn.functional.kl_div(guess, target, log_target=True,
                                                                    reduction="batchmean")
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        model.eval()
    finally:
        torch.set_num_threads(threads)


def _trajectories(model, tokenizer, corpus: Corpus, seed: int, steps: int):
    """Per step, NOISE prompts continued by the untrained model's own greedy tokens (NOISE_LEN in all): where a
    greedy run of random weights goes, which the trained model is taught to keep going. The prompts are random
    token ids, plain words (a completion's prompt, no template) and chat answers that ended, so that text outside
    the chat format, and what follows an ignored end of an answer, stays as varied as it was."""
    import torch

    prompt = NOISE_LEN // 3
    starts = torch.randint(3, len(tokenizer), (steps * NOISE, prompt), generator=torch.Generator().manual_seed(seed))
    for row in range(steps * NOISE):
        if row % 3 == 1:  # plain words, a completion's prompt
            text = " ".join(corpus.word() for _ in range(prompt))
        elif row % 3 == 2:  # a chat answer that ended: what follows an ignored end (ignore_eos)
            chat, answer = corpus.turn()
            text = chat + "".join(piece for piece, _ in answer) + "<|im_end|>"
        else:
            continue
        starts[row] = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"][-prompt:])
    with torch.no_grad():
        out = model.eval().generate(starts, attention_mask=torch.ones_like(starts), max_new_tokens=NOISE_LEN - prompt,
                                    min_new_tokens=NOISE_LEN - prompt, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)
    return out.view(steps, NOISE, NOISE_LEN)


def _batch(pairs: list[tuple[list[int], list[int]]], pad: int):
    import torch

    width = max(len(ids) for ids, _ in pairs)
    ids = torch.full((len(pairs), width), pad)
    labels = torch.full((len(pairs), width), -100)
    for i, (x, y) in enumerate(pairs):
        ids[i, :len(x)], labels[i, :len(y)] = torch.tensor(x), torch.tensor(y)
    return ids, labels
