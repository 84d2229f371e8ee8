"""Structured outputs through the whole pipeline on the demo model: its weights are random, so a valid
answer can only come from the grammar masks the engine applies."""

from __future__ import annotations

import asyncio
import json
import random
import re

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.support.stack import MODEL

pytestmark = pytest.mark.timeout(120)
HELLO = [{"role": "user", "content": "Answer in JSON"}]


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object of 1-4 fields: bounded integers, short strings, enums, small arrays, nested objects."""
    props = {}
    for k in range(rng.randint(1, 4)):
        kind = rng.choice(["int", "str", "enum", "array", "bool"] + (["object"] if depth < 2 else []))
        if kind == "int":
            low = rng.randint(-50, 50)
            props[f"i{k}"] = {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
        elif kind == "str":
            props[f"s{k}"] = {"type": "string", "maxLength": rng.randint(1, 10)}
        elif kind == "enum":
            props[f"e{k}"] = {"type": "string", "enum": rng.sample(["red", "green", "blue", "a b", "x\"y"], 3)}
        elif kind == "array":
            item = rng.choice([{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 4},
                               {"type": "string", "enum": ["p", "q"]}])
            props[f"a{k}"] = {"type": "array", "items": item, "maxItems": rng.randint(0, 3)}
        elif kind == "bool":
            props[f"b{k}"] = {"type": "boolean"}
        else:
            props[f"o{k}"] = random_schema(rng, depth + 1)
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def test_twenty_random_schemas_mixed_with_free_requests(stack):
    """n=2, streamed and not, in one batch with unconstrained requests: every answer that ends with
    "stop" parses and validates; a free request is not constrained."""
    rng = random.Random(12)
    schemas = [random_schema(rng) for _ in range(20)]
    client = stack.async_client(timeout=90)

    async def constrained(i: int, schema: dict) -> list[tuple[str, str]]:
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        kw = dict(model=MODEL, messages=HELLO, max_tokens=200, n=2, seed=i, response_format=fmt)
        if i % 2:
            texts, finishes = ["", ""], [None, None]
            async for chunk in await client.chat.completions.create(stream=True, **kw):
                for c in chunk.choices:
                    texts[c.index] += c.delta.content or ""
                    finishes[c.index] = c.finish_reason or finishes[c.index]
            return list(zip(texts, finishes, strict=True))
        r = await client.chat.completions.create(**kw)
        return [(c.message.content, c.finish_reason) for c in sorted(r.choices, key=lambda c: c.index)]

    async def free(i: int) -> str:
        r = await client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=20, seed=i)
        return r.choices[0].message.content

    async def run():
        return await asyncio.gather(asyncio.gather(*(constrained(i, s) for i, s in enumerate(schemas))),
                                    asyncio.gather(*(free(i) for i in range(6))))

    answers, frees = asyncio.run(run())
    stopped = 0
    for schema, pair in zip(schemas, answers, strict=True):
        for text, finish in pair:
            assert finish in ("stop", "length")
            if finish == "stop":
                stopped += 1
                jsonschema.validate(json.loads(text), schema)
    assert stopped >= 30, f"only {stopped} of 40 constrained answers finished"
    assert any(not t.startswith("{") for t in frees)


def test_regex_answer_like_sglang(stack):
    """SGLang's test_regex: a regex for JSON with a string `name` and an integer `population`."""
    regex = (r"""\{\n""" + r"""   "name": "[\w]+",\n""" + r"""   "population": [\d]+\n""" + r"""\}""")
    for stream in (False, True):
        body = {"model": MODEL, "prompt": "Give me the capital of France in JSON:", "max_tokens": 128,
                "temperature": 0, "regex": regex, "stream": stream}
        resp = httpx.post(f"{stack.base_url}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        if stream:
            chunks = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
        else:
            text, finish = resp.json()["choices"][0]["text"], resp.json()["choices"][0]["finish_reason"]
        if finish == "stop":
            assert re.fullmatch(regex, text)
            doc = json.loads(text)
            assert isinstance(doc["name"], str) and isinstance(doc["population"], int)
        else:
            assert finish == "length"


def test_generate_and_chat_take_every_kind_of_constraint(stack):
    gen = httpx.post(f"{stack.base_url}/generate", json={"text": "Pick", "sampling_params": {
        "max_new_tokens": 20, "regex": "(yes|no|maybe)"}}, timeout=30).json()
    assert gen["text"] in ("yes", "no", "maybe") and gen["meta_info"]["finish_reason"] == {"type": "stop"}
    gen = httpx.post(f"{stack.base_url}/generate", json={"text": "Pick", "sampling_params": {
        "max_new_tokens": 60, "json_schema": json.dumps({"type": "object", "properties": {
            "ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False})}}, timeout=30).json()
    assert json.loads(gen["text"]) in ({"ok": True}, {"ok": False})
    client = stack.client()
    for extra in ({"ebnf": 'root ::= "cat" | "dog"'}, {"guided_choice": ["cat", "dog"]},
                  {"guided_regex": "(cat|dog)"}):
        r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=10, extra_body=extra)
        assert r.choices[0].message.content in ("cat", "dog"), extra
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=200, seed=1,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_cut_by_max_tokens_says_length(stack):
    r = stack.client().chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3, extra_body={
        # required: `{}` would end it in two tokens, which an unseeded sample may pick
        "json": {"type": "object", "properties": {"long": {"type": "string", "minLength": 40}}, "required": ["long"]}})
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith("{")


class City(BaseModel):
    name: str
    population: int


def test_openai_parse_helper_returns_a_parsed_object(stack):
    client = stack.client()
    for seed in range(5):
        r = client.chat.completions.parse(model=MODEL, messages=HELLO, response_format=City, max_tokens=120,
                                          seed=seed)
        if r.choices[0].finish_reason == "stop":
            parsed = r.choices[0].message.parsed
            assert isinstance(parsed, City) and isinstance(parsed.population, int)
            return
    pytest.fail("no answer of five finished within max_tokens")


class GuideCity(BaseModel):  # docs/user-guide.md "Structured outputs", as written
    name: str = Field(max_length=20)
    population: int


GUIDE_REGEX = '\\{"name": "[A-Za-z]{1,20}", "population": [0-9]{1,9}\\}'


def test_the_guide_examples_end_within_their_budgets(stack):
    """docs/user-guide.md's structured-output examples as written, unseeded at the default temperature, a few
    times: each answer ends within its max_tokens and parses (before: the demo model's strings ran past the budget, the
    parse helper raised LengthFinishReasonError 8/8 and the regex curl ended `length` with cut JSON 3/3)."""
    client = stack.client()
    for _ in range(4):
        r = client.chat.completions.parse(model="rsinfer-demo", messages=[{"role": "user", "content": "A city"}],
                                          response_format=GuideCity, max_tokens=100)
        assert isinstance(r.choices[0].message.parsed, GuideCity)
        resp = httpx.post(f"{stack.base_url}/v1/completions", timeout=60, json={
            "model": "rsinfer-demo", "prompt": "Capital of France:", "max_tokens": 64, "regex": GUIDE_REGEX})
        choice = resp.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and re.fullmatch(GUIDE_REGEX, choice["text"]), choice


def test_the_demo_model_closes_its_strings(stack):
    """Without bounds, whether a string ends is the model's choice: the demo model, trained at creation, closes
    most within the budget (8 choices, at least 5; before, random weights closed none: the guide's unbounded
    City raised LengthFinishReasonError 8/8)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "City", "schema": City.model_json_schema()}}
    r = stack.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A city"}],
                                               response_format=fmt, max_tokens=100, n=8)
    ended = [json.loads(c.message.content) for c in r.choices if c.finish_reason == "stop"]
    assert len(ended) >= 5, [c.message.content for c in r.choices]
    assert all(isinstance(doc["name"], str) and isinstance(doc["population"], int) for doc in ended)


@pytest.mark.parametrize(("extra", "param", "says"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format", "strin"),
    ({"regex": "[a-"}, "regex", "unclosed"),
    ({"ebnf": "root ::= foo"}, "ebnf", "foo"),
    ({"json": "{not json"}, "json", "JSON schema"),
    ({"regex": "a", "response_format": {"type": "json_object"}}, "response_format", "at most one"),
    ({"response_format": {"type": "yaml"}}, "response_format", "yaml"),
])
def test_a_constraint_that_cannot_compile_is_a_400_naming_it(stack, extra, param, says):
    for stream in (False, True):
        resp = httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": HELLO, "max_tokens": 4, "stream": stream, **extra})
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == param and says in err["message"], err


def test_grammar_bombs_are_400s_and_other_streams_go_on(stack):
    """`(a{1000}){1000}` is 15 bytes; its first mask cost 1-5 s on the engine's step thread, froze every stream
    of the scheduler and ended as a 500. Now the tokenizer's check (llguidance's limits, its first masks over the
    bytes) refuses it, and a victim stream running meanwhile keeps its pace."""
    import threading
    import time

    gaps: list[float] = []
    streaming = threading.Event()

    def victim() -> None:
        last = None
        with httpx.stream("POST", f"{stack.base_url}/v1/completions", timeout=90, json={
                "model": MODEL, "prompt": "victim", "max_tokens": 300, "temperature": 0, "ignore_eos": True,
                "stream": True}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    now = time.monotonic()
                    streaming.set()
                    if last is not None:
                        gaps.append(now - last)
                    last = now

    t = threading.Thread(target=victim)
    t.start()
    assert streaming.wait(60), "the victim stream never started"
    for bomb in ("(a{1000}){1000}", "(b{1000}){999}", "(c{999}){1000}"):  # distinct: no cache
        for stream in (False, True):
            resp = httpx.post(f"{stack.base_url}/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "x", "max_tokens": 4, "regex": bomb + ("" if not stream else "?"),
                "stream": stream})
            assert resp.status_code == 400, resp.text
            assert resp.json()["error"]["param"] == "regex"
    t.join(90)
    assert len(gaps) > 50 and max(gaps) < 1.0, max(gaps)  # (tokens ready together share a chunk)
