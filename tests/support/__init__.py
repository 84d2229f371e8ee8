"""Test-only code the test layers (and bench/soak.py) share: the process stack the end-to-end tests run
(stack.py, over rsinfer/launcher.py), streaming clients over rsinfer/sse_client.py (streaming.py), helpers
(helpers.py), a local Redis Cluster (redis_cluster.py), the chaos machinery (chaos_kit.py) and a scheduler
that fails on purpose (poison_scheduler.py)."""
