"""The routing decision's bound on load skew (services/tokenizer/router.py `choose`, a pure function) and the load
it bounds (`Router.loads_now`, from heartbeats and each scheduler's own stream), without Redis."""

import time

from redis.exceptions import ResponseError

from services.tokenizer.router import Candidate, Policy, Router, choose
from shared import streams
from shared.keys import Keys


def test_a_prefix_holder_past_the_skew_bound_is_passed_over_for_the_shared_stream():
    # s1 holds the prefix; 3 requests over idle s2: within a bound of 4 it still gets it, past a bound of 2 not
    assert choose({"s1": 512, "s2": 0}, {"s1": 3, "s2": 0}, 64, max_skew=4) == "s1"
    assert choose({"s1": 512, "s2": 0}, {"s1": 3, "s2": 0}, 64, max_skew=2) is None
    assert choose({"s1": 512, "s2": 0}, {"s1": 3, "s2": 0}, 64) == "s1"  # unbounded: the cache wins, as before


def test_the_bound_leaves_the_best_holder_within_it():
    load = {"s1": 6, "s2": 3, "s3": 2}
    # s1 holds the most but is 4 over s3; s2 holds less, within 2 of s3: the best of those within the bound
    assert choose({"s1": 800, "s2": 512, "s3": 0}, load, 16, max_skew=2) == "s2"
    assert choose({"s1": 800, "s2": 512, "s3": 0}, load, 16, max_skew=4) == "s1"
    # only an overloaded scheduler holds it: the shared stream, where whoever has room takes it
    assert choose({"s1": 800, "s2": 0, "s3": 0}, load, 16, max_skew=2) is None
    # the bound is relative to the least loaded: all busy alike, the holder still gets it
    assert choose({"s1": 800, "s2": 0}, {"s1": 9, "s2": 9}, 16, max_skew=0) == "s1"


def test_a_schedulers_unfinished_jobs_are_read_from_its_own_streams_group():
    groups = [{"name": b"other", "pending": 9, "lag": 9}, {"name": b"scheduler", "pending": 2, "lag": 3}]
    assert streams.unfinished(groups, "scheduler") == 5
    assert streams.unfinished([{"name": "scheduler", "pending": 1, "lag": None}], "scheduler") == 1  # lag unknown
    assert streams.unfinished([], "scheduler") == 0  # no group yet
    assert streams.unfinished(ResponseError("ERR no such key"), "scheduler") == 0  # no stream yet


def test_a_schedulers_load_is_the_more_of_its_beat_and_its_unfinished_routed_jobs():
    router = Router(None, Keys(), "m", heartbeat_ttl_s=5, policy=Policy(64))  # type: ignore[arg-type]
    router.candidates = [Candidate("s1", 16, 3.0), Candidate("s2", 16, 1.0), Candidate("s3", 16, 0.0)]
    router.sent = {"s1": [time.time()] * 6}  # routed since its beat, since ended: not counted
    assert router.loads_now({"s1": 2, "s2": 4}) == {"s1": 3.0, "s2": 4.0, "s3": 0.0}
