"""What the unit tests of several stages share: tokenizers that take seconds to build, made once per process; and
the groups that keep the users of one costly session fixture on one xdist worker (`--dist loadgroup`), so that it
is made once per run, not once per worker."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.xdist_groups import apply_groups

# Session fixtures whose users are grouped: six redis-servers that take ~2 s to form a cluster; ~2.5 s of CPU. Tests
# that take one by name at run time (request.getfixturevalue) carry the group's mark on their parameter.
GROUPED = ("redis_cluster", "qwen_tok")
UNIT = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unit = [item for item in items if UNIT in item.path.parents]  # this hook sees every item of the run
    for item in unit:
        for name in GROUPED:
            if name in getattr(item, "fixturenames", ()):
                item.add_marker(pytest.mark.xdist_group(name))
    apply_groups(config, unit)


@pytest.fixture(scope="session")
def qwen_tok():
    """The real Qwen vocabulary (~150k tokens) as shared/demo_model.py gives the qwen3-0.6b shape: its markup tokens
    and ChatML template. Read-only: ~2.5 s of CPU to convert, so made once."""
    from shared.demo_model import CHATML_TEMPLATE, MARKUP_TOKENS, _qwen_tokenizer

    tok = _qwen_tokenizer()
    tok.add_tokens(MARKUP_TOKENS)
    tok.chat_template = CHATML_TEMPLATE
    return tok
