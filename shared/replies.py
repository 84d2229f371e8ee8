"""Moved to shared/reply_order.py (ordering and fencing of a reply stream); this name stays for the modules not
ported yet (services/api/flow.py, services/api/gateway.py, services/scheduler/main.py,
tests/unit/scheduler/test_recovery.py), to go once they import from there."""

from shared.reply_order import OrderedReplies, ProducedTokens

__all__ = ["OrderedReplies", "ProducedTokens"]
