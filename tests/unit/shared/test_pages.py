"""How a request's cache salt names its prefix-cache pages (shared/pages.py), without Redis or an engine."""

from __future__ import annotations

from shared.pages import adapter_root, extend_digests, isolation_salt, prefix_root


def digests(tokens: list[int], root: bytes) -> list[bytes]:
    out: list[bytes] = []
    extend_digests(out, tokens, 4, len(tokens) // 4, root)
    return out


def test_no_salt_keeps_the_names_pages_had_before():
    assert isolation_salt("", None) == isolation_salt("", "") == ""
    assert prefix_root(None, "") == b"" and prefix_root("sql", "") == adapter_root("sql")


def test_each_scope_and_salt_is_a_root_of_its_own():
    salts = {isolation_salt(scope, salt) for scope in ("", "tenant:a", "tenant:b", "salt:a")
             for salt in (None, "x", "xy")} - {""}
    assert len(salts) == 11  # 4 scopes x 3 salts, less open mode without a salt
    assert all(len(s) == 32 for s in salts), "a fixed size whatever the client sends"
    assert isolation_salt("tenant:a", None) == isolation_salt("tenant:a", "") != isolation_salt("salt:a", None)
    # length-prefixed: moving a character from the scope to the salt is another salt
    assert isolation_salt("tenant:ab", "c") != isolation_salt("tenant:a", "bc")
    roots = {prefix_root(adapter, s) for adapter in (None, "sql") for s in ("", *salts)}
    assert len(roots) == 24


def test_no_page_of_one_salt_is_named_as_any_page_of_another():
    tokens = list(range(64))
    a, b = (digests(tokens, prefix_root(None, isolation_salt(f"tenant:{t}", None))) for t in "ab")
    plain = digests(tokens, b"")
    assert len(a) == 16 and not set(a) & set(b) and not set(a) & set(plain)
    assert a == digests(tokens, prefix_root(None, isolation_salt("tenant:a", None))), "stable across processes"
