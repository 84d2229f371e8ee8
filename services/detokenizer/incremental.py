"""Incremental detokenization with no per-request state.

The text of a completion through token k is what tokens [0, k) add to the prompt's text, as a reference
server shows it: decode(prompt + tokens[:k]) past where it departs from decode(prompt), with two things
held back: a trailing unfinished UTF-8 character (decoded as at most three U+FFFD, as SGLang's
DecodeStatus holds it) and a trailing piece that could still grow into a stop string. The text sent for
tokens [start, end) is the difference between that text at `end` and at `start`, computed from a window
of the tokens just before `start` (`TokenDelta.context`, sent by the scheduler), which begins with the
prompt's last tokens while the completion is shorter than it (so a SentencePiece first word keeps its
leading space); text of those prompt tokens is never sent. So any replica turns the same range into the
same text, and a replica that takes over a dead peer's entries needs nothing from it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from services.detokenizer.token_bytes import TokenBytes
from shared.messages import TokenDelta, TokenLogprob, TopLogprob

REPLACEMENT = "\ufffd"
THINK_OPEN = "<think>"  # what a reasoning template ends its prompt with when it makes the model think
# An unfinished UTF-8 character is at most 3 bytes, shown as one U+FFFD (byte-level BPE) or one per byte
# (byte-fallback); any replacement character before those is final and may be shown.
HELD_REPLACEMENTS = 3


@dataclass(frozen=True)
class Rendered:
    text: str
    stopped: bool  # a stop string ended this choice; text is cut before it
    stop: str | None = None  # which one (Anthropic's `stop_sequence`)


def stop_hold(text: str, stops: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string. Only the places in the
    text's tail where a stop string's first character occurs are tried (a few, in text that does not look like
    it), not every length up to the stop string's: that was ~1 ms a delta with 16 stop strings of 256 bytes."""
    best, n = 0, len(text)
    for stop in stops:
        if len(stop) < 2:
            continue
        first = stop[0]
        i = text.find(first, max(0, n - len(stop) + 1))
        while i != -1 and n - i > best:  # the earliest match is this stop string's longest
            if stop.startswith(text[i:]):
                best = n - i
                break
            i = text.find(first, i + 1)
    return best


def visible(text: str, stops: list[str], final: bool) -> str:
    """What may be shown of `text` now: all of it when final, else minus held-back parts."""
    if final:
        return text
    text = _without_unfinished_character(text)
    return text[: len(text) - stop_hold(text, stops)] if stops else text


def _without_unfinished_character(text: str) -> str:
    # Holding back only what may still change (not a whole run of garbage bytes) keeps the held part
    # inside the context window, so every split of a token range renders the same text.
    end = len(text)
    while end > 0 and len(text) - end < HELD_REPLACEMENTS and text[end - 1] == REPLACEMENT:
        end -= 1
    return text[:end]


def render_delta(before: str, after: str, stops: list[str], final: bool) -> Rendered:
    """Text to send for the tokens that turned window text `before` into `after`."""
    shown = visible(before, stops, final=False)
    if not after.startswith(shown):  # decoding merged across the boundary; never resend text
        shown = after[: _common_prefix(shown, after)]
    hit = _first_stop(after, stops, len(shown))
    if hit is not None:
        cut, stop = hit
        return Rendered(after[len(shown):max(cut, len(shown))], True, stop)
    return Rendered(visible(after, stops, final)[len(shown):], False)


def after_prompt(prompt: str, before: str, after: str) -> tuple[str, str]:
    """The completion's part of a window's texts (before and after the new tokens): what follows the text
    of the window's prompt tokens, from where either departs from it (a character the prompt left
    unfinished and the completion finished belongs to the completion, as in decode(prompt + completion)
    minus decode(prompt))."""
    if before.startswith(prompt) and after.startswith(prompt):
        cut = len(prompt)
    else:
        cut = min(_common_prefix(prompt, before), _common_prefix(prompt, after))
    return before[cut:], after[cut:]


def _first_stop(text: str, stops: list[str], shown: int) -> tuple[int, str] | None:
    """Start of the earliest stop string ending past what was already shown, and that string (of two at one
    place, the shorter: it ended first)."""
    hits = [(i, len(s), s) for s in stops if s and (i := text.find(s, max(0, shown - len(s) + 1))) != -1]
    return min(hits)[::2] if hits else None


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def merge_deltas(items: list[TokenDelta], published: Mapping[tuple[str, int], int] | None = None) -> list[TokenDelta]:
    """Join consecutive, contiguous deltas of the same choice (several engine steps in one read) so
    that one reply entry carries them all.

    A delta ending at or before what this replica already published for its choice (`published`: the end of
    the last range written, by uid and choice) is a step written twice: it stays alone, as the step it was.
    Joined to the new steps after it, it would make a range that overlaps what the API delivered, which the
    API cannot cut by token and drops (shared/reply_order.py), holding every later range for a gap that
    nothing fills.

    Deltas of two epochs are never joined: a scheduler let go after a peer took its request over sends the steps
    it made meanwhile, and one of them may end where the successor's next range starts. Joined under the
    older epoch, the successor's tokens would be refused with it, leaving its client a gap that nothing fills."""
    import msgspec

    out: list[TokenDelta] = []
    last: dict[tuple[str, int], int] = {}
    for it in items:
        key = (it.uid, it.index)
        if published is not None and it.start + len(it.ids) <= published.get(key, -1):
            last.pop(key, None)
            out.append(it)
            continue
        j = last.get(key)
        prev = out[j] if j is not None else None
        if (prev is not None and prev.finish is None and prev.epoch == it.epoch
                and prev.start + len(prev.ids) == it.start):
            out[j] = msgspec.structs.replace(
                prev, ids=prev.ids + it.ids, finish=it.finish, trace=prev.trace or it.trace,
                logprobs=_concat(prev.logprobs, it.logprobs), top_logprobs=_concat(prev.top_logprobs,
                                                                                   it.top_logprobs))
        else:
            last[key] = len(out)
            out.append(it)
    return out


def _concat(a: list | None, b: list | None) -> list | None:
    return None if a is None and b is None else (a or []) + (b or [])


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.token_bytes = TokenBytes(tokenizer)  # logprobs' `bytes`: each token's own
        self.thinks = THINK_OPEN in tokenizer.get_vocab()  # a reasoning vocabulary (Qwen3's, DeepSeek-R1's)

    def render(self, items: list[TokenDelta]) -> list[Rendered]:
        """Render many deltas with one batched decode per skip_special_tokens setting: each window before
        and after its new tokens, and the prompt part of windows holding prompt and completion tokens."""
        out: list[Rendered | None] = [None] * len(items)
        for skip in (True, False):
            idx = [i for i, it in enumerate(items) if it.skip_special_tokens == skip]
            if not idx:
                continue
            # At start 0 the window before the new tokens is the prompt part itself: no third decode.
            mixed = [i for i in idx if 0 < items[i].start < len(items[i].context)]
            windows = ([items[i].context for i in idx] + [items[i].context + items[i].ids for i in idx]
                       + [items[i].context[:len(items[i].context) - items[i].start] for i in mixed])
            texts = self.decode_batch(windows, skip)
            prompt_texts = dict(zip(mixed, texts[2 * len(idx):], strict=True))
            for k, i in enumerate(idx):
                it = items[i]
                before, after = texts[k], texts[k + len(idx)]
                if it.start < len(it.context):
                    before, after = after_prompt(prompt_texts.get(i, before), before, after)
                out[i] = render_delta(before, after, it.stop, it.finish is not None)
        return out  # type: ignore[return-value]

    def decode_batch(self, windows: list[list[int]], skip_special_tokens: bool) -> list[str]:
        """tokenizer.batch_decode without cleanup. A fast tokenizer's Rust backend decodes the whole batch in
        one call; transformers would decode each window separately in Python (about half of this stage's
        CPU), for the same text (its `_decode` is the backend's `decode` when cleanup is off)."""
        if self.backend is not None:
            return self.backend.decode_batch(windows, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.batch_decode(windows, skip_special_tokens=skip_special_tokens,
                                           clean_up_tokenization_spaces=False)

    def logprobs(self, it: TokenDelta) -> list[TokenLogprob] | None:
        if it.logprobs is None:
            return None
        tops = it.top_logprobs or [[] for _ in it.ids]
        return [self._logprob(tid, lp, top) for tid, lp, top in zip(it.ids, it.logprobs, tops, strict=False)]

    def _logprob(self, token_id: int, logprob: float | None, top: list[tuple[int, float]]) -> TokenLogprob:
        return TokenLogprob(token=self._token(token_id), logprob=logprob, bytes=self.token_bytes(token_id),
                            top_logprobs=[TopLogprob(token=self._token(i), logprob=v, bytes=self.token_bytes(i))
                                          for i, v in top])

    def first_range(self, it: TokenDelta) -> dict:
        """A choice's first range: the prompt's text (echo), its tokens' logprobs, the cached tokens, and whether
        the prompt opened the thinking (its last tokens, the delta's context, end with `<think>`): the API's
        reasoning parser then reads the answer as reasoning until `</think>`."""
        if it.start != 0:
            return {}
        out: dict = {"cached_tokens": it.cached_tokens}
        if self.thinks and it.context and self.decode_batch([it.context], False)[0].rstrip().endswith(THINK_OPEN):
            out["thinking"] = True
        if it.prompt_ids is not None:
            out["prompt_text"] = self.tokenizer.decode(it.prompt_ids, skip_special_tokens=it.skip_special_tokens)
            if it.prompt_logprobs is not None:
                scores = [(None, []), *it.prompt_logprobs][:len(it.prompt_ids)]
                out["prompt_logprobs"] = [self._logprob(tid, lp, top)
                                          for tid, (lp, top) in zip(it.prompt_ids, scores, strict=False)]
        return out

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
