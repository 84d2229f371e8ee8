"""`--dist loadgroup` on pytest 9.2: pytest now derives an item's nodeid from its structured `_id`, while
pytest-xdist 3.8.0 still marks a grouped item by rewriting `_nodeid`, which no longer takes effect, so every
`xdist_group` is silently ignored (pytest-dev/pytest-xdist#1386). `apply_groups` gives the items their group suffix
the way xdist's scheduler reads it (`<nodeid>@<group>`); a no-op without loadgroup or where xdist's own works."""

from __future__ import annotations

import pytest


def apply_groups(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Call from a conftest's `pytest_collection_modifyitems` once the items carry their `xdist_group` marks."""
    if not getattr(config.option, "loadgroup", False):  # set on xdist's workers under --dist loadgroup
        return
    try:
        from _pytest.nodeid import NodeId
    except ImportError:  # pytest < 9.2: xdist's rewrite works
        return
    for item in items:
        groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                         for m in item.iter_markers("xdist_group")})
        if groups and "@" not in item.nodeid.rpartition("]")[2] and hasattr(item, "_id"):
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(groups)}")
