"""The routing decision's bound on load skew (services/tokenizer/router.py `choose`), alone: a pure function."""

from services.tokenizer.router import choose


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
