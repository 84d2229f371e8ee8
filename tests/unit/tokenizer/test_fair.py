"""services/tokenizer/fair.py: which held job goes next, and how many go (no Redis)."""

from services.tokenizer.fair import FairQueue, releasable


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
