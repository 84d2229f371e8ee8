"""Tenants: the keys file, the policy of what a key may do, and its quotas (shared through Redis)."""
