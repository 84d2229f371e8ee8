"""Stop strings travel once per request, not with every engine step: what a request with many long stop
strings writes into Redis does not grow with steps x stop bytes, and the text is still cut where the stop
string starts: one that spans many tokens, n > 1, streamed or not, and a request resumed by another scheduler
and rendered by a detokenizer that never saw its first delta (it reads them from the record)."""

from __future__ import annotations

import random
import signal
import threading
import time
import uuid

import httpx
import msgspec
import pytest

from shared.messages import ReplyEvent, SamplingParams, TokenizeJob, decode, encode
from shared.streams import FIELD
from tests.support.helpers import live_names, wait_for
from tests.support.stack import LIFECYCLE_ENV, MODEL, running_pipeline

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def pipeline(redis_server, random_model_dir, tmp_path_factory):
    """The stages on the demo checkpoint's random twin (tests/conftest.py): stop strings are cut out of long greedy
    texts, which random weights keep varied (the trained demo model's may settle into a loop, where a stop string
    taken from late in the text is found early)."""
    with running_pipeline(redis_server, random_model_dir, tmp_path_factory, "stops") as s:
        yield s


def submit(stack, prompt: str, params: SamplingParams) -> str:
    """Publish a tokenize job as another team's producer would (docs/asyncapi.yaml), with no API in between and
    so none of its limits: a background request (no API process owns it), its record first."""
    r, uid = stack.redis(), uuid.uuid4().hex
    now = time.time()
    job = TokenizeJob(uid=uid, model=MODEL, pod="test", created_at=now, deadline=now + 120, params=params,
                      prompt=prompt, background=True)
    r.hset(stack.keys.request(uid), mapping={"status": "queued", "model": MODEL, "n": params.n, "background": 1})
    r.expire(stack.keys.request(uid), 600)
    r.xadd(stack.keys.tokenize(MODEL), {FIELD: encode(job)})
    return uid


def reply_text(stack, uid: str, timeout: float = 90) -> tuple[str, str]:
    """The text and finish reason of choice 0 of a submitted request, once it finished."""
    r = stack.redis()
    wait_for(lambda: r.hget(stack.keys.request(uid), "status") in ("finished", "failed", "aborted"), timeout=timeout,
             every=0.05)
    text, finish = "", None
    for _, fields in r.xrange(stack.keys.reply(uid)):
        raw = fields[FIELD.decode()]
        if '"kind":"delta"' not in raw:
            continue
        ev = decode(raw, ReplyEvent)
        text += ev.text
        finish = ev.finish_reason or finish
    return text, finish


def bytes_in(stack) -> int:
    return int(stack.redis().info("stats")["total_net_input_bytes"])


def never_matching(count: int, size: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"{k:04d}" + "".join(rng.choice("qxzjQXZJ") for _ in range(size - 4)) for k in range(count)]


def test_long_stop_strings_are_written_once_per_request_not_per_step(pipeline):
    """16 stop strings of 4 KiB (64 KiB) on a 200-token request: before, every step's delta carried all of them
    (>= 200 x 64 KiB, 12.5 MiB); now the job, the schedule job, the record and each choice's first delta do, and
    the deltas carry a few more context tokens."""
    s, steps = pipeline, 200
    stops = never_matching(16, 4096, 1)
    total = sum(len(x) for x in stops)
    base = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
    reply_text(s, submit(s, "warm up", base))
    written, texts = {}, {}
    for name, params in (("plain", base), ("stops", msgspec.structs.replace(base, stop=stops))):
        before = bytes_in(s)
        uid = submit(s, "Once upon a time", params)
        texts[name] = reply_text(s, uid)
        written[name] = bytes_in(s) - before
    assert texts["stops"] == texts["plain"] and texts["plain"][1] == "length"  # no stop string matched
    extra = written["stops"] - written["plain"]
    assert extra < 12 * total, (written, f"{extra / total:.1f} x the stop strings' bytes")
    assert s.redis().hget(s.keys.request(uid), "stop").startswith('["0000')  # where a replica finds them


def test_a_stop_string_spanning_many_tokens_cuts_the_text_where_it_starts(pipeline):
    client = pipeline.client()
    base = dict(model=MODEL, prompt="A long story", temperature=0, max_tokens=120, extra_body={"ignore_eos": True})
    full = client.completions.create(**base).choices[0].text
    start = len(full) // 3
    stop = full[start:start + 40]  # about a dozen of the demo tokenizer's tokens
    expected = full[:full.find(stop)]
    for stream in (False, True):
        if stream:
            chunks = list(client.completions.create(**base, stop=[stop, "never-seen-zzqx"], stream=True))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        else:
            r = client.completions.create(**base, stop=[stop, "never-seen-zzqx"])
            text, finish = r.choices[0].text, [r.choices[0].finish_reason]
        assert (text, finish) == (expected, ["stop"]), stream


def test_each_of_n_choices_is_cut_by_its_own_stop(pipeline):
    client = pipeline.client()
    base = dict(model=MODEL, prompt="Two tellings", temperature=0.9, seed=5, n=3, max_tokens=80,
                extra_body={"ignore_eos": True})
    full = [c.text for c in sorted(client.completions.create(**base).choices, key=lambda c: c.index)]
    assert len(set(full)) == 3
    stops = [full[0][20:32], full[1][40:50]]
    cut = [min((t.find(x) for x in stops if x in t), default=-1) for t in full]
    r = client.completions.create(**base, stop=stops)
    for c in r.choices:
        i = c.index
        want = (full[i][:cut[i]], "stop") if cut[i] >= 0 else (full[i], "length")
        assert (c.text, c.finish_reason) == want, i


def test_a_resumed_request_rendered_by_a_new_detokenizer_still_stops(pipeline):
    """The scheduler dies mid-request and a peer resumes it; the detokenizer is replaced too, so the one that
    renders the rest never saw the choice's first delta (which carried the stop strings) and reads them from the
    request record."""
    s = pipeline
    base = {"model": MODEL, "prompt": "resume with a stop", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    full = httpx.post(f"{s.base_url}/v1/completions", json=base, timeout=90).json()["choices"][0]["text"]
    stop = full[int(len(full) * 0.8):int(len(full) * 0.8) + 12]
    expected = full[:full.find(stop)]
    result: dict = {}

    def run() -> None:
        result["r"] = httpx.post(f"{s.base_url}/v1/completions", json={**base, "stop": [stop]}, timeout=120).json()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    r = s.redis()
    uid = wait_for(lambda: next((s.keys.uid_of_request_key(k) for k in r.scan_iter(match=s.keys.request_pattern())
                                 if r.hget(k, "stop") and r.hget(k, "status") == "running"), None), timeout=30)
    wait_for(lambda: replied_up_to(r, s.keys.reply(uid)) >= 64, timeout=60)
    [old], [detok] = live_names(s, "scheduler"), live_names(s, "detokenizer")
    s.procs[old].send_signal(signal.SIGSTOP)
    s.kill(detok)
    s.start("detokenizer-new", "detokenizer", **LIFECYCLE_ENV)
    s.start("scheduler-new", "scheduler", **LIFECYCLE_ENV)
    s.kill(old)
    t.join(120)
    choice = result["r"]["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (expected, "stop")
    assert r.hget(s.keys.request(uid), "scheduler").startswith("scheduler-new@")


def replied_up_to(r, key: str) -> int:
    """The end of the last token range in a reply stream (0 before any)."""
    raws = [fields[FIELD.decode()] for _, fields in r.xrevrange(key, count=4)]
    return next((decode(raw, ReplyEvent).end for raw in raws if '"kind":"delta"' in raw), 0)
