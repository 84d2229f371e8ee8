"""Reply events -> OpenAI chunks and bodies."""

from __future__ import annotations

from services.api.answer.formats import ChatFormat, CompletionFormat, Head
from shared.messages import ReplyEvent, TokenLogprob
from shared.reply_order import OrderedReplies

NO_COUNTS = OrderedReplies(1)  # no usage in these chunks


def lp(token: str, value: float) -> TokenLogprob:
    return TokenLogprob(token=token, logprob=value, bytes=list(token.encode()), top_logprobs=[])


def test_a_token_whose_text_is_held_back_still_streams_its_logprob():
    """A token ending in half a UTF-8 character has no text yet, but its logprob must not be lost."""
    for fmt in (CompletionFormat(Head("c", "m", 0, 1, True, False)), ChatFormat(Head("c", "m", 0, 1, True, False))):
        fmt.chunks([ReplyEvent(0, 1, "a", 3, logprobs=[lp("a", -1.0)])], NO_COUNTS)
        chunks = fmt.chunks([ReplyEvent(1, 2, "", 3, logprobs=[lp("\ufffd", -2.0)])], NO_COUNTS)
        assert len(chunks) == 1, type(fmt).__name__
        (choice,) = chunks[0]["choices"]
        assert choice.get("delta", {"content": choice.get("text")})["content"] == ""  # not an empty delta


def test_held_back_logprobs_keep_content_with_a_parser():
    """A reasoning parser's chat: the held-back token's chunk still says `content` (clients read it)."""
    fmt = ChatFormat(Head("c", "m", 0, 1, True, False), {"reasoning": "qwen3"})
    fmt.chunks([ReplyEvent(0, 1, "a", 3, logprobs=[lp("a", -1.0)])], NO_COUNTS)
    (chunk,) = fmt.chunks([ReplyEvent(1, 2, "", 3, logprobs=[lp("\ufffd", -2.0)])], NO_COUNTS)
    assert chunk["choices"][0]["delta"] == {"content": ""} and chunk["choices"][0]["logprobs"]["content"]


def test_echo_prepends_the_prompt_and_its_logprobs():
    fmt = CompletionFormat(Head("c", "m", 0, 1, True, False), echo=True)
    prompt = [TokenLogprob("Hi", None, [72, 105], []), lp(" there", -3.0)]
    [first] = fmt.chunks([ReplyEvent(0, 1, "!", 2, logprobs=[lp("!", -1.0)], prompt_text="Hi there",
                                     prompt_logprobs=prompt)], NO_COUNTS)
    choice = first["choices"][0]
    assert choice["text"] == "Hi there!"
    assert choice["logprobs"]["token_logprobs"] == [None, -3.0, -1.0]
    assert choice["logprobs"]["top_logprobs"][0] is None and choice["logprobs"]["text_offset"] == [0, 2, 8]
    [second] = fmt.chunks([ReplyEvent(1, 2, "?", 2, logprobs=[lp("?", -1.5)])], NO_COUNTS)
    assert second["choices"][0]["logprobs"]["text_offset"] == [9]


def test_usage_is_the_counts_given():
    counts = OrderedReplies(1)
    fmt = ChatFormat(Head("c", "m", 0, 1, False, True))
    fmt.continuous_usage = True
    counts.accept(ReplyEvent(0, 2, "ab", 5, ids=[1, 2]))
    [chunk] = fmt.chunks([ReplyEvent(0, 2, "ab", 5)], counts)
    assert chunk["usage"]["prompt_tokens"] == 5 and chunk["usage"]["completion_tokens"] == 2
    assert fmt.usage_chunk(counts)["usage"]["total_tokens"] == 7
    fmt.add([ReplyEvent(0, 2, "ab", 5, finish_reason="stop")])
    assert fmt.response(counts)["usage"]["completion_tokens"] == 2


def test_a_batch_replayed_up_to_the_last_event_id_is_formatted_but_not_sent():
    """A reattach: entries the client has go into the format (the echo, the text offsets) without a chunk."""
    fmt = CompletionFormat(Head("c", "m", 0, 1, False, False))
    batch = [("1-0", ReplyEvent(0, 1, "a", 2)), ("2-0", ReplyEvent(1, 2, "b", 2))]
    chunks, event_id = fmt.batch_chunks(batch, NO_COUNTS, replay_until="1-0")
    assert [c["choices"][0]["text"] for c in chunks] == ["b"] and event_id == "2-0"
    assert fmt.choices[0].length == 2  # "a" counted, unsent
    assert CompletionFormat(Head("c", "m", 0, 1, False, False)).batch_chunks(batch[:1], NO_COUNTS, "1-0") == ([], None)
