"""Request uids made to land in a chosen cluster slot, checked against a real cluster's CLUSTER KEYSLOT."""

from __future__ import annotations

import random

import redis

from shared import slots
from shared.keys import Keys


def test_uids_land_in_the_slot_asked_for():
    rng = random.Random(7)
    wanted = [0, 1, slots.SLOTS - 1, *(rng.randrange(slots.SLOTS) for _ in range(3000))]
    uids = [slots.uid_in_slot(s) for s in wanted]
    assert [slots.key_slot(Keys().reply(u)) for u in uids] == wanted
    assert all(len(u) == 32 and set(u) <= set("0123456789abcdef") for u in uids)
    assert len(set(uids)) == len(uids)


def test_every_key_of_a_request_is_in_its_uid_slot_as_the_server_computes_it(redis_cluster):
    keys = Keys("ns1")
    uid = slots.uid_in_slot(1234)
    with redis.Redis(port=redis_cluster.ports[0]) as node:
        for key in (keys.request(uid), keys.reply(uid), keys.abort(uid), keys.choice_stop(uid, 3)):
            assert node.cluster("keyslot", key) == 1234, key
        tag = slots.uid_in_slot(99)
        assert node.cluster("keyslot", keys.control("pod@1.ab", 0, tag)) == 99
    assert keys.uid_of_request_key(keys.request(uid)) == uid
