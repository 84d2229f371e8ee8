"""`POST /v1/embeddings` (the official openai client) and `POST /v1/score` (SGLang's test cases, over HTTP)
against `rsinfer up`: what they return equals the same computation on transformers' demo model, alongside a
streaming generation, and bad input is a 400 naming its field."""

from __future__ import annotations

import base64
import threading

import httpx
import numpy as np
import openai
import pytest
import torch

from tests.support.stack import MODEL

pytestmark = pytest.mark.timeout(120)
TEXTS = ["The quick brown fox", "jumps over the lazy dog", "héllo wörld ✓"]


@pytest.fixture(scope="module")
def hf(demo_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(demo_model_dir)


def hf_embedding(hf, ids: list[int]) -> np.ndarray:
    model, _ = hf
    with torch.inference_mode():
        last = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1].float()
    return torch.nn.functional.normalize(last, dim=0).numpy()


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def post(stack, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{stack.base_url}{path}", json=body, timeout=60)


def test_embeddings_of_text_lists_and_token_ids_equal_transformers(stack, hf):
    client, tok = stack.client(), hf[1]
    ids = [tok(t)["input_ids"] for t in TEXTS]
    single = client.embeddings.create(model=MODEL, input=TEXTS[0])
    listed = client.embeddings.create(model=MODEL, input=TEXTS)
    by_ids = client.embeddings.create(model=MODEL, input=ids[1])
    by_id_lists = client.embeddings.create(model=MODEL, input=ids)
    assert single.object == "list" and single.model == MODEL and len(single.data) == 1
    assert single.data[0].object == "embedding" and single.data[0].index == 0
    assert single.usage.prompt_tokens == len(ids[0]) == single.usage.total_tokens
    assert listed.usage.prompt_tokens == sum(map(len, ids))
    assert [d.index for d in listed.data] == [0, 1, 2]
    for k, ref in enumerate(hf_embedding(hf, i) for i in ids):
        assert cosine(listed.data[k].embedding, ref) >= 0.9999
        assert cosine(by_id_lists.data[k].embedding, ref) >= 0.9999
    assert cosine(single.data[0].embedding, hf_embedding(hf, ids[0])) >= 0.9999
    assert cosine(by_ids.data[0].embedding, hf_embedding(hf, ids[1])) >= 0.9999
    assert len(single.data[0].embedding) == hf[0].config.hidden_size


def test_base64_decodes_to_the_same_floats(stack):
    floats = post(stack, "/v1/embeddings", {"model": MODEL, "input": TEXTS, "encoding_format": "float"}).json()
    b64 = post(stack, "/v1/embeddings", {"model": MODEL, "input": TEXTS, "encoding_format": "base64"}).json()
    for f, b in zip(floats["data"], b64["data"], strict=True):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        # two requests may be batched differently, so their floats agree to rounding, not in every bit
        np.testing.assert_allclose(decoded, np.asarray(f["embedding"], dtype=np.float32), rtol=1e-4, atol=1e-5)


def test_embeddings_while_a_generation_streams(stack, hf):
    client, tok = stack.client(), hf[1]
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell a story"}],
                                            max_tokens=200, temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)  # the generation is running in the scheduler now
    results: list = []
    worker = threading.Thread(target=lambda: results.append(client.embeddings.create(model=MODEL, input=TEXTS)))
    worker.start()
    rest = list(chunks)
    worker.join(60)
    assert first.choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == "length"
    [emb] = results
    for k, text in enumerate(TEXTS):
        assert cosine(emb.data[k].embedding, hf_embedding(hf, tok(text)["input_ids"])) >= 0.9999


def test_embedding_fields_are_bounded_and_refused_by_name(stack):
    client = stack.client()
    cases = [({"input": TEXTS[0], "dimensions": 16}, "dimensions", "does not support truncating"),
             ({"input": ""}, "input", "empty string"),
             ({"input": []}, "input", "must not be empty"),
             ({"input": ["x"] * 129}, "input", "--max-pooling-inputs"),
             ({"input": [[1] * 8193]}, "input", "--max-pooling-input-tokens"),
             ({"input": [5, 10**6]}, "input", "outside the vocabulary"),
             ({"input": "x", "encoding_format": "int8"}, "encoding_format", "")]
    for extra, param, words in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.embeddings.create(model=MODEL, **extra)
        body = err.value.body
        assert body["param"] == param and words in body["message"], body
    hidden = client.embeddings.create(model=MODEL, input="x", dimensions=128)  # its own size: no truncation
    assert len(hidden.data[0].embedding) == 128


def hf_scores(hf, prompts: list[list[int]], labels: list[int], apply_softmax: bool) -> list[list[float]]:
    model, _ = hf
    out = []
    for ids in prompts:
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        probs = torch.softmax(logits[labels], -1) if apply_softmax else torch.softmax(logits, -1)[labels]
        out.append(probs.tolist())
    return out


def close(a: list[list[float]], b: list[list[float]], tol: float = 1e-5) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for ra, rb in zip(a, b, strict=True)
                                    for x, y in zip(ra, rb, strict=True))


@pytest.mark.parametrize("case", [
    {"query": "I pledge allegiance", "items": ["", " to"], "item_first": False},  # SGLang's default case
    {"query": " is a city", "items": ["Tokyo", "Japan"], "item_first": True},  # and its item_first case
])
@pytest.mark.parametrize("apply_softmax", [True, False])
def test_score_text_cases_equal_transformers(stack, hf, case, apply_softmax):
    tok = hf[1]
    labels = [tok(t, add_special_tokens=False)["input_ids"][0] for t in (" to", " the")]
    r = post(stack, "/v1/score", {**case, "label_token_ids": labels, "apply_softmax": apply_softmax, "model": MODEL})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "scoring" and body["model"] == MODEL
    texts = [f"{i}{case['query']}" if case["item_first"] else f"{case['query']}{i}" for i in case["items"]]
    prompts = [tok(t)["input_ids"] for t in texts]
    assert close(body["scores"], hf_scores(hf, prompts, labels, apply_softmax))
    assert body["usage"]["prompt_tokens"] == sum(map(len, prompts)) and body["usage"]["completion_tokens"] == 0
    for row in body["scores"]:
        assert all(0 <= s <= 1 for s in row)
        if apply_softmax:
            assert abs(sum(row) - 1.0) < 1e-6


def test_score_token_input_and_batches(stack, hf):
    query, items = [11, 12, 13, 14], [[20, 21], [30], [40, 41, 42]]
    for item_first in (False, True):
        r = post(stack, "/v1/score", {"query": query, "items": items, "label_token_ids": [1, 2, 3],
                                      "apply_softmax": False, "item_first": item_first})  # `model` may be left out
        assert r.status_code == 200, r.text
        prompts = [i + query if item_first else query + i for i in items]
        assert close(r.json()["scores"], hf_scores(hf, prompts, [1, 2, 3], False))
    for size in (1, 2, 4, 8):  # SGLang's test_score_batch_handling
        r = post(stack, "/v1/score", {"query": "The test was", "items": [f"test {i}" for i in range(size)],
                                      "label_token_ids": [1, 2, 3], "apply_softmax": True})
        scores = r.json()["scores"]
        assert len(scores) == size and all(len(s) == 3 and abs(sum(s) - 1) < 1e-6 for s in scores)


def test_score_errors_name_the_field(stack, hf):
    vocab = hf[0].config.vocab_size
    cases = [({"label_token_ids": [1, vocab]}, "label_token_ids", f"Token ID {vocab}"),
             ({"label_token_ids": []}, "label_token_ids", "must be provided"),
             ({"label_token_ids": [-1]}, "label_token_ids", "nonnegative"),
             ({"items": []}, "items", "must be provided"),
             ({"query": [1, 2]}, "items", "both be text or both be token ids"),
             ({"items": ["a"] * 129}, "items", "--max-pooling-inputs"),
             ({"stream": True}, "stream", "")]
    for extra, param, words in cases:
        r = post(stack, "/v1/score", {"query": "q", "items": ["a"], "label_token_ids": [1], **extra})
        assert r.status_code == 400, (extra, r.text)
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"], error


def test_metrics_count_embeddings_and_scores(stack):
    def ttft_count() -> float:
        text = httpx.get(f"{stack.base_url}/metrics").text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("rsinfer_time_to_first_token_seconds_count"))

    before = ttft_count()
    stack.client().embeddings.create(model=MODEL, input="count me")
    stack.client().embeddings.create(model=MODEL, input=["count", "us"])
    post(stack, "/v1/score", {"query": "q", "items": ["a"], "label_token_ids": [1]})
    text = httpx.get(f"{stack.base_url}/metrics").text
    for endpoint in ("embedding", "score"):
        assert f'endpoint="{endpoint}",model="{MODEL}",status="ok"' in text or \
            f'model="{MODEL}",endpoint="{endpoint}",status="ok"' in text
    assert ttft_count() == before  # they make no token


def test_prefill_only_requests_pass_the_tokenize_and_schedule_streams_not_the_detokenizer(stack):
    """What KEDA's triggers read (the tokenize stream's lag, the schedule stream's pending entries: helm's
    keda.yaml) counts them as it counts generations; no detokenize entry is written for them."""
    r, k = stack.redis(), stack.keys

    def read(stream: str) -> int:
        return sum(int(g["entries-read"] or 0) for g in r.xinfo_groups(stream))

    before = (read(k.tokenize(MODEL)), read(k.schedule(MODEL)), r.xinfo_stream(k.detokenize(MODEL))["entries-added"])
    stack.client().embeddings.create(model=MODEL, input=TEXTS)
    post(stack, "/v1/score", {"query": "q", "items": ["a", "b"], "label_token_ids": [1]})
    after = (read(k.tokenize(MODEL)), read(k.schedule(MODEL)), r.xinfo_stream(k.detokenize(MODEL))["entries-added"])
    assert after[0] - before[0] == 5 and after[1] - before[1] == 5  # one job per input and per item
    assert after[2] == before[2]


def test_inspect_shows_embeddings_and_scores(stack):
    import subprocess
    import sys

    stack.client().embeddings.create(model=MODEL, input="shown")
    post(stack, "/v1/score", {"query": "q", "items": ["shown"], "label_token_ids": [1]})
    out = subprocess.run([sys.executable, "-m", "rsinfer.cli", "inspect", "--all", "--redis-url", stack.redis_url,
                          "--namespace", stack.namespace], capture_output=True, text=True, timeout=30)
    rows = [line.split() for line in out.stdout.splitlines()]
    assert any(row[1:3] == ["finished", "embedding"] for row in rows if len(row) > 3), out.stdout
    assert any(row[1:3] == ["finished", "score"] for row in rows if len(row) > 3), out.stdout
