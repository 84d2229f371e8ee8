"""Reading a reply stream in order with fences and checkpoints (shared/reply_order.py)."""

from __future__ import annotations

from shared.messages import ReplyCheckpoint, ReplyEvent, ReplyFence
from shared.reply_order import OrderedReplies, ProducedTokens


def ev(start: int, ids: list[int], epoch: int = 0, finish: str | None = None, index: int = 0) -> ReplyEvent:
    return ReplyEvent(start=start, end=start + len(ids), text="".join(f"<{i}>" for i in ids), prompt_tokens=1,
                      index=index, ids=ids, finish_reason=finish, epoch=epoch)


def delivered(order: OrderedReplies, messages: list) -> list[int]:
    out: list[int] = []
    for m in messages:
        if isinstance(m, ReplyFence):
            order.fence(m.epoch)
        elif not isinstance(m, ReplyCheckpoint):  # as the API's reader, which delivers ranges only
            out += [t for e in order.accept(m) for t in e.ids]
    return out


def test_a_taken_over_schedulers_tokens_after_the_fence_never_reach_the_client():
    """Owner 0 stalls after token 2; owner 1 resumes from what lies before its fence and samples other
    tokens. Owner 0 wakes and publishes its token 3 after the fence: refused, so the text is one sequence."""
    stream = [ev(0, [10]), ev(1, [11]), ev(2, [12]), ReplyFence(epoch=1),
              ev(3, [99]),  # the stalled owner's step, made before it noticed
              ev(3, [13], epoch=1), ev(4, [14], epoch=1, finish="length")]
    order = OrderedReplies(1)
    assert delivered(order, stream) == [10, 11, 12, 13, 14]
    assert order.refused == 1 and order.done


def test_held_ranges_of_an_older_epoch_are_forgotten_at_the_fence():
    """A range after a gap was never part of the successor's resume point, so it must not fill the gap."""
    stream = [ev(0, [10]), ev(2, [99]), ReplyFence(epoch=1), ev(1, [11], epoch=1), ev(2, [12], epoch=1)]
    assert delivered(OrderedReplies(1), stream) == [10, 11, 12]


def test_a_resume_reads_the_tokens_before_the_fence_and_past_the_cap_from_a_checkpoint():
    """The stream's head was trimmed (MAXLEN): the checkpoint has every token up to 6, then ranges follow."""
    produced = ProducedTokens(2, trimmed=True)
    for m in [ReplyCheckpoint(epoch=0, outputs=[[1, 2, 3, 4, 5, 6], [7, 8]]), ev(5, [6]),  # already covered
              ev(6, [20]), ev(2, [30], index=1), ev(7, [21]), ReplyFence(epoch=1), ev(8, [98])]:
        produced.add(m)
    assert produced.outputs == [[1, 2, 3, 4, 5, 6, 20, 21], [7, 8, 30]]
    assert not produced.failed and not produced.done


def test_an_older_checkpoint_after_a_fence_is_ignored():
    produced = ProducedTokens(1)
    for m in [ev(0, [1]), ReplyFence(epoch=2), ReplyCheckpoint(epoch=1, outputs=[[1, 9, 9, 9]])]:
        produced.add(m)
    assert produced.outputs == [[1]]


def test_a_range_straddling_a_later_checkpoint_still_gives_its_tokens_past_it():
    """The scheduler writes a checkpoint (tokens to 67) straight into the stream while the detokenizer,
    behind it, still has to append the ranges [66, 68) and [68, 70): a client got 67..69 from those, so a
    resume must not start at 67 (it would sample index 67 a second time, differently)."""
    produced = ProducedTokens(1)
    head = list(range(100, 166))
    for m in [ev(0, head), ReplyCheckpoint(epoch=1, outputs=[[*head, 166]]), ev(66, [166, 167]),
              ev(68, [168, 169])]:
        produced.add(m)
    assert produced.outputs == [[*head, 166, 167, 168, 169]]


def test_a_checkpoint_ahead_of_the_ranges_does_not_move_the_resume_point():
    """The scheduler wrote a checkpoint with token 3 in it straight into the stream; the detokenizer appends the
    range of token 3 only after the successor's fence, where every reader refuses it (epoch 0). Resuming at the
    checkpoint would leave the client waiting at token 3 for ever: the successor must make token 3 again."""
    before_fence = [ev(0, [1, 2]), ev(2, [3]), ReplyCheckpoint(epoch=0, outputs=[[1, 2, 3, 4]])]
    produced = ProducedTokens(1)
    for m in before_fence:
        produced.add(m)
    produced.fence(1)
    assert produced.outputs == [[1, 2, 3]]
    client = OrderedReplies(1)
    successor = [ev(3, [44], epoch=1), ev(4, [45], epoch=1, finish="length")]
    assert delivered(client, [*before_fence, ReplyFence(epoch=1), ev(3, [4]), *successor]) == [1, 2, 3, 44, 45]
    assert client.done


def test_a_range_after_a_gap_does_not_move_the_resume_point_past_it():
    produced = ProducedTokens(1)
    for m in [ev(0, [1]), ev(3, [4, 5, 6]), ReplyCheckpoint(epoch=0, outputs=[[1, 2, 3, 4]])]:
        produced.add(m)
    assert produced.outputs == [[1]]


def test_a_fence_keeps_what_its_successor_resumed_from():
    """After a fence, a later resume of a trimmed stream takes the tokens before its first range from what the
    fence's successor resumed from, not from an older checkpoint that ran ahead of it."""
    produced = ProducedTokens(1)
    for m in [ev(0, [1, 2]), ReplyCheckpoint(epoch=0, outputs=[[1, 2, 3]]), ReplyFence(epoch=1),
              ev(2, [3]), ev(2, [33], epoch=1), ev(3, [34], epoch=1), ReplyFence(epoch=2)]:
        produced.add(m)
    assert produced.outputs == [[1, 2, 33, 34]]
    assert produced.known == [[1, 2, 33, 34]] and produced.epoch == 2


def test_a_trimmed_stream_past_every_checkpoint_cannot_be_resumed():
    produced = ProducedTokens(1, trimmed=True)
    for m in [ReplyCheckpoint(epoch=0, outputs=[[1, 2]]), ev(5, [6])]:
        produced.add(m)
    assert produced.unresumable


def test_a_reader_of_a_trimmed_stream_starts_each_choice_at_its_first_range():
    order = OrderedReplies(2)
    order.start_headless()
    stream = [ev(40, [1], index=1), ev(70, [2]), ev(72, [4]), ev(71, [3]), ev(41, [5], index=1)]
    assert delivered(order, stream) == [1, 2, 3, 4, 5]
    assert order.next == [73, 42]


def test_an_event_of_a_newer_epoch_fences_like_its_trimmed_fence():
    """MAXLEN may have trimmed the fence away; the successor's ranges come after it all the same."""
    stream = [ev(5, [15], epoch=1), ev(6, [99], epoch=0), ev(6, [16], epoch=1)]
    order = OrderedReplies(1)
    order.start_headless()
    assert delivered(order, stream) == [15, 16]
    assert order.refused == 1
