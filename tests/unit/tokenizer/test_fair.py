"""services/tokenizer/fair.py: which held job goes next, and how many go (no Redis)."""

from services.tokenizer.fair import FairQueue, applies, holds, plan, refills, releasable


def test_releasable_fills_the_schedule_stream_up_to_the_watermark():
    assert releasable(backlog=0, watermark=4, held=10) == 4
    assert releasable(backlog=3, watermark=4, held=10) == 1
    assert releasable(backlog=4, watermark=4, held=10) == 0
    assert releasable(backlog=9, watermark=4, held=10) == 0  # over it (several tokenizers released at once)
    assert releasable(backlog=0, watermark=4, held=2) == 2
    assert releasable(backlog=0, watermark=4, held=0) == 0


def test_one_tenant_alone_is_first_in_first_out():
    q: FairQueue[int] = FairQueue()
    for i in range(5):
        q.push("a", 1, i)
    assert q.take(10) == [0, 1, 2, 3, 4]
    assert q.pop() is None and len(q) == 0


def test_a_late_tenant_waits_one_turn_not_the_flood():
    q: FairQueue[str] = FairQueue()
    for i in range(200):
        q.push("a", 1, f"a{i}")
    assert q.take(3) == ["a0", "a1", "a2"]
    q.push("b", 1, "b0")
    assert q.take(2) == ["a3", "b0"]  # a's turn, then b's: one of a's jobs ahead, not 197
    assert q.take(2) == ["a4", "a5"]
    assert q.tenants() == {"a": 194}


def test_turns_are_weighted():
    q: FairQueue[str] = FairQueue()
    for i in range(9):
        q.push("a", 3, f"a{i}")
        q.push("b", 1, f"b{i}")
    assert q.take(8) == ["a0", "a1", "a2", "b0", "a3", "a4", "a5", "b1"]


def test_an_emptied_lane_leaves_the_round_and_comes_back_at_its_end():
    q: FairQueue[str] = FairQueue()
    q.push("a", 1, "a0")
    q.push("b", 1, "b0")
    q.push("b", 1, "b1")
    assert q.take(2) == ["a0", "b0"]
    q.push("a", 1, "a1")
    q.push("c", 1, "c0")
    assert q.take(4) == ["b1", "a1", "c0"]


def test_removed_items_leave_order_and_turns_alone():
    q: FairQueue[str] = FairQueue()
    for i in range(4):
        q.push("a", 2, f"a{i}")
        q.push("b", 1, f"b{i}")
    assert q.pop() == "a0"  # a's turn has one more
    assert sorted(q.remove(lambda x: x in {"a2", "b0", "b1"})) == ["a2", "b0", "b1"]
    assert q.take(10) == ["a1", "b2", "a3", "b3"]
    assert q.remove(lambda x: True) == [] and len(q) == 0


def test_removing_the_head_lane_ends_its_turn():
    q: FairQueue[str] = FairQueue()
    for i in range(3):
        q.push("a", 5, f"a{i}")
    q.push("b", 5, "b0")
    assert q.pop() == "a0"
    q.remove(lambda x: x.startswith("a"))
    q.push("a", 5, "a9")
    assert q.take(3) == ["b0", "a9"]


def test_a_failed_release_goes_back_to_the_head_of_its_lane():
    q: FairQueue[str] = FairQueue()
    for i in range(3):
        q.push("a", 1, f"a{i}")
    taken = q.take(2)
    for item in reversed(taken):
        q.restore("a", 1, item)
    assert q.take(3) == ["a0", "a1", "a2"]


# -- the hold's cap: hold or park (services/tokenizer/holding.py applies it)
def test_fair_queueing_applies_when_set_or_when_a_job_has_a_tenant():
    assert applies(True, "") and applies(True, "a")
    assert not applies(False, "a")
    assert applies(None, "a") and not applies(None, "")  # unset: keys configured, not open mode


def test_within_the_cap_every_job_is_held_unless_its_tenant_has_jobs_parked():
    assert holds({"a": 3}, "a", parked=set(), max_held=4)
    assert holds({"a": 3}, "b", parked={"a"}, max_held=4)
    assert not holds({"a": 1}, "a", parked={"a"}, max_held=4)  # behind its own parked jobs: first in, first out


def test_past_the_cap_only_a_tenant_under_its_share_is_held_and_never_past_twice_the_cap():
    assert not holds({"a": 8}, "a", parked=set(), max_held=8)  # the flooder's excess is parked
    assert holds({"a": 8}, "b", parked=set(), max_held=8)  # b's share is 4 of 8
    assert holds({"a": 8, "b": 3}, "b", parked=set(), max_held=8)
    assert not holds({"a": 8, "b": 4}, "b", parked=set(), max_held=8)
    assert holds({"a": 8, "b": 3}, "c", parked=set(), max_held=8)  # 8 / 3 = 2
    assert holds({"a": 15}, "b", parked=set(), max_held=8) and not holds({"a": 16}, "b", parked=set(), max_held=8)


def test_a_flood_past_the_cap_is_parked_and_another_tenant_still_held():
    p = plan([("a", True, f"a{i}") for i in range(6)] + [("b", True, "b0"), ("o", False, "o0"), ("a", True, "a6")],
             lanes={}, parked=set(), max_held=4)
    assert p.hold == ["a0", "a1", "a2", "a3", "b0"] and p.park == ["a4", "a5", "a6"] and p.send == ["o0"]


def test_parked_jobs_come_back_into_the_emptiest_lanes_first_within_the_cap():
    targets = {"a": 4, "b": 4, "c": 2}
    assert refills({"a": 3}, ["a", "b", "c"], targets, max_held=10) == {"b": 4, "c": 2, "a": 1}
    assert refills({"a": 6}, ["a", "b", "c"], targets, max_held=10) == {"b": 4}  # b, then c: no room left
    assert refills({"x": 9}, ["b", "c"], targets, max_held=10) == {"b": 1}
    assert refills({"x": 12}, ["b"], targets, max_held=10) == {}


def test_within_a_lane_deadlines_go_first_earliest_first_and_others_keep_their_order():
    due = {"a-late": 9.0, "a-soon": 2.0, "a-soon2": 2.0, "b-soon": 1.0}
    q: FairQueue[str] = FairQueue(lambda item: due.get(item, float("inf")))
    for item in ("a0", "a1", "a-late", "a2", "a-soon", "a-soon2"):
        q.push("a", 1, item)
    for item in ("b0", "b-soon"):
        q.push("b", 1, item)
    # a's lane: its deadlines first (earliest first, ties in arrival order), then the rest FIFO; b's turn still
    # comes after one of a's: a deadline is earlier only within its own tenant's lane
    assert q.take(8) == ["a-soon", "b-soon", "a-soon2", "b0", "a-late", "a0", "a1", "a2"]
