"""Reply events -> OpenAI chunks and bodies."""

from __future__ import annotations

from services.api.formats import ChatFormat, CompletionFormat
from shared.messages import ReplyEvent, TokenLogprob
from shared.replies import OrderedReplies

NO_COUNTS = OrderedReplies(1)  # no usage in these chunks


def lp(token: str, value: float) -> TokenLogprob:
    return TokenLogprob(token=token, logprob=value, bytes=list(token.encode()), top_logprobs=[])


def test_a_token_whose_text_is_held_back_still_streams_its_logprob():
    """A token ending in half a UTF-8 character has no text yet, but its logprob must not be lost."""
    for fmt in (CompletionFormat("c", "m", 0, 1, True, False), ChatFormat("c", "m", 0, 1, True, False)):
        fmt.chunks([ReplyEvent(0, 1, "a", 3, logprobs=[lp("a", -1.0)])], NO_COUNTS)
        chunks = fmt.chunks([ReplyEvent(1, 2, "", 3, logprobs=[lp("\ufffd", -2.0)])], NO_COUNTS)
        assert len(chunks) == 1, type(fmt).__name__


def test_echo_prepends_the_prompt_and_its_logprobs():
    fmt = CompletionFormat("c", "m", 0, 1, True, False, echo=True)
    prompt = [TokenLogprob("Hi", None, [72, 105], []), lp(" there", -3.0)]
    [first] = fmt.chunks([ReplyEvent(0, 1, "!", 2, logprobs=[lp("!", -1.0)], prompt_text="Hi there",
                                     prompt_logprobs=prompt)], NO_COUNTS)
    choice = first["choices"][0]
    assert choice["text"] == "Hi there!"
    assert choice["logprobs"]["token_logprobs"] == [None, -3.0, -1.0]
    assert choice["logprobs"]["top_logprobs"][0] is None and choice["logprobs"]["text_offset"] == [0, 2, 8]
    [second] = fmt.chunks([ReplyEvent(1, 2, "?", 2, logprobs=[lp("?", -1.5)])], NO_COUNTS)
    assert second["choices"][0]["logprobs"]["text_offset"] == [9]
