"""Prefix-cache isolation (issue 35, item 3): the paged engine shares a prompt's pages only between requests of one
cache salt, and names them as the tokenizer's router does (shared/pages.py `prefix_root`)."""

from __future__ import annotations

import pytest

from services.scheduler.engine.base import EngineRequest
from services.tokenizer.router import prompt_pages
from shared.pages import isolation_salt
from tests.unit.engine.util import clone_model, drain, engine, greedy, prompts, tokens


@pytest.fixture(scope="module")
def engine_model(demo_model):
    return clone_model(demo_model)


def first_cached(eng, uid: str, prompt: list[int], salt: str) -> tuple[int, list[int]]:
    """The cached_tokens a request reports, and its greedy tokens."""
    out = drain(eng, {0: [EngineRequest(uid, prompt, greedy(4), cache_salt=salt)]})[(uid, 0)]
    return out[0].cached_tokens, tokens(out)


def test_pages_are_shared_within_a_salt_and_never_across(demo_model, engine_model):
    eng = engine(engine_model, page_size=4)
    prompt = prompts([37], demo_model.config.vocab_size, seed=3)[0]  # 9 full pages of 4
    salt_a, salt_b = (isolation_salt(f"tenant:{t}", None) for t in ("a", "b"))
    cached_a, text_a = first_cached(eng, "a1", prompt, salt_a)
    assert cached_a == 0
    cached_b, text_b = first_cached(eng, "b1", prompt, salt_b)
    assert cached_b == 0, "another tenant's first request reads none of A's pages"
    assert text_b == text_a, "a salt changes the pages' names, not what they hold"
    assert first_cached(eng, "a2", prompt, salt_a)[0] == 36, "A's repeat reads its own pages"
    assert first_cached(eng, "open", prompt, "")[0] == 0, "the unsalted (open mode) scope is a scope of its own"
    own = isolation_salt("tenant:a", "user-7")
    assert first_cached(eng, "a-user", prompt, own)[0] == 0, "a request's cache_salt splits a tenant's scope"
    assert first_cached(eng, "a-user2", prompt, own)[0] == 36


def test_the_router_names_a_salted_prompt_as_the_engine_caches_it(demo_model, engine_model):
    eng = engine(engine_model, page_size=4)
    prompt = prompts([21], demo_model.config.vocab_size, seed=4)[0]
    salt = isolation_salt("salt:docs", None)
    drain(eng, {0: [EngineRequest("r", prompt, greedy(2), cache_salt=salt)]})
    held = {d.hex() for d in eng.prefix_digests()}
    assert set(prompt_pages(prompt, 4, salt)) <= held
    assert not set(prompt_pages(prompt, 4)) & held, "unsalted routing finds none of a salted request's pages"
    assert not set(prompt_pages(prompt, 4, isolation_salt("salt:other", None))) & held
