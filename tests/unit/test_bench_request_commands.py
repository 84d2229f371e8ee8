"""bench/request_commands.py's arithmetic: the idle rate taken out, and a request's commands split into the fixed
part and the part per token."""

from __future__ import annotations

import pytest

from bench.request_commands import per_request, split


def test_the_idle_rate_over_the_run_is_taken_out_per_request():
    calls = {"xadd": 230, "hset": 100, "ping": 20}
    idle = {"ping": 2.0, "hset": 1.0}  # per second
    got = per_request(calls, seconds=10.0, requests=10, idle=idle)
    assert got == {"xadd": 23.0, "hset": 9.0}  # ping: all of it idle


def test_a_request_splits_into_fixed_and_per_token():
    # C(T) = fixed + T * per_token: xadd 3 + 2 per token, hset 6 and nothing per token
    one = {"xadd": 5.0, "hset": 6.0}
    many = {"xadd": 3.0 + 2 * 33, "hset": 6.0}
    fixed, per_token = split(one, many, 33)
    assert fixed == {"hset": 6.0, "xadd": 3.0}
    assert per_token == pytest.approx({"xadd": 2.0})
