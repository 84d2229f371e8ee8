"""LoRA adapters through the whole pipeline, with real processes: two API processes, a tokenizer, a scheduler
with 3 adapter slots and a detokenizer on the demo model (fp32), and random PEFT adapters made here (non-zero
init, rank 8 and 16, different target modules).

Shown: greedy output through rsinfer, per adapter, equals transformers' `generate` on the PEFT model merged into
the base, streamed and not; the base and 3 adapters sent together give what each gives alone; more adapters in
use than slots all complete with the same texts; an adapter loaded, used, unloaded and loaded again (other
weights under the same name) through two API processes; an unknown adapter is a 404, a bad folder a 400 at load
naming its field, and the scheduler serves on; `/v1/models`, `/metrics` and `rsinfer inspect` show the adapters.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from rsinfer.launcher import api_ready
from rsinfer.redis_server import free_port
from tests.support.helpers import live_names, wait_for, workers
from tests.support.stack import LIFECYCLE_ENV, MODEL, Stack, new_stack, start_replicas
from tests.support.streaming import Streamer
from tests.support.streaming import reference as texts_of

pytestmark = pytest.mark.timeout(300)

KEY = "sk-api-key-of-this-test-" + "0" * 16  # keys have at least 32 characters

N = 12  # tokens per request
SLOTS = 3
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SPECS = {  # name -> LoraConfig arguments; "sql" comes from --lora-modules, the others are loaded at run time
    "sql": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "chat": dict(r=16, lora_alpha=32, target_modules=ALL),
    "mlp": dict(r=16, lora_alpha=8, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "kv": dict(r=8, lora_alpha=8, target_modules=["k_proj", "o_proj"], layers_to_transform=[1, 3]),
}
PROMPTS = [[(k * 131 + i * 17) % 900 + 40 for i in range(length)] for k, length in enumerate((9, 23, 40))]


@pytest.fixture(scope="module")
def demo_model(random_model_dir):
    """The demo checkpoint's random-weight twin (tests/conftest.py), which the stack serves too: random weights
    keep each adapter's effect on the greedy tokens visible."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(str(random_model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def made(demo_model, tmp_path_factory):
    """name -> (folder, merged reference model); "chat-v2": other weights, for a reload under the same name."""
    from tests.unit.engine.util import make_adapter

    root = tmp_path_factory.mktemp("adapters")
    specs = {**SPECS, "chat-v2": SPECS["chat"]}
    return {name: (root / name, make_adapter(demo_model, root / name, seed=k + 1, **spec))
            for k, (name, spec) in enumerate(specs.items())}


@pytest.fixture(scope="module")
def reference(demo_model, made):
    """(adapter or None, prompt index) -> transformers' greedy tokens on the merged model."""
    from tests.unit.engine.util import hf_greedy

    ref = {(None, i): hf_greedy(demo_model, p, N) for i, p in enumerate(PROMPTS)}
    for name, (_, merged) in made.items():
        ref.update({(name, i): hf_greedy(merged, p, N) for i, p in enumerate(PROMPTS)})
    return ref


@pytest.fixture(scope="module")
def lora(redis_server, random_model_dir, tmp_path_factory, made):
    """The stack, once for the module: "sql" registered by the scheduler's --lora-modules, "chat", "mlp" and
    "kv" loaded through the API (each through another process of the two)."""
    s = new_stack(redis_server, random_model_dir, tmp_path_factory, "lora")
    store = tmp_path_factory.mktemp("store")
    s.store = store
    s.lora_env = {**LIFECYCLE_ENV, "RSINFER_MAX_LORAS": str(SLOTS), "RSINFER_MAX_LORA_RANK": "16",
                  "RSINFER_MAX_ADAPTERS": "8", "RSINFER_MAX_KV_TOKENS": "8192", "RSINFER_PAGE_SIZE": "4",
                  "RSINFER_STORAGE_URL": f"file://{store}", "RSINFER_STORAGE_CACHE_DIR": str(store / ".cache"),
                  "RSINFER_LORA_MODULES": f"sql={made['sql'][0]}",
                  "RSINFER_LORA_ROOTS": str(tmp_path_factory.getbasetemp())}  # the adapters made here, the store
    try:
        s.api_ports = start_replicas(s, {}, apis=2, **s.lora_env)
        wait_for(lambda: "sql" in _names(s), 60, 0.2)
        for k, name in enumerate(("chat", "mlp", "kv")):
            resp = load(s, name, made[name][0], api=k % 2)
            assert resp.status_code == 200, resp.text
        yield s
    finally:
        s.stop()


def url(s: Stack, api: int = 0) -> str:
    return f"http://127.0.0.1:{s.api_ports[api]}"


def load(s: Stack, name: str, path, api: int = 0, **extra) -> httpx.Response:
    return httpx.post(f"{url(s, api)}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path),
                                                                    **extra}, timeout=30)


def unload(s: Stack, name: str, api: int = 0) -> httpx.Response:
    return httpx.post(f"{url(s, api)}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=30)


def _names(s: Stack) -> list[str]:
    return [m["id"] for m in httpx.get(f"{s.base_url}/v1/models", timeout=10).json()["data"]]


def generate(s: Stack, model: str | None, prompt: list[int], api: int = 0, stream: bool = False, **extra) -> dict:
    """/generate, greedy: its output ids (the last body of a stream)."""
    body = {"model": model or MODEL, "input_ids": prompt, "stream": stream, **extra,
            "sampling_params": {"max_new_tokens": N, "temperature": 0, "ignore_eos": True}}
    with httpx.stream("POST", f"{url(s, api)}/generate", json=body, timeout=60) as resp:
        raw = resp.read().decode()
    assert resp.status_code == 200, raw
    if not stream:
        return json.loads(raw)
    bodies = [line[6:] for line in raw.splitlines() if line.startswith("data: ") and line[6:] != "[DONE]"]
    return json.loads(bodies[-1])


def client(s: Stack, api: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url(s, api)}/v1", api_key="unused", max_retries=0, timeout=60)


def completion_text(s: Stack, model: str, prompt: list[int], stream: bool, api: int = 0) -> str:
    kw = dict(model=model, prompt=prompt, max_tokens=N, temperature=0, extra_body={"ignore_eos": True})
    if not stream:
        return client(s, api).completions.create(**kw).choices[0].text
    return "".join(c.choices[0].text for c in client(s, api).completions.create(stream=True, **kw) if c.choices)


def together(calls: list) -> list:
    """Run the calls at once, each in a thread of its own; their results in order."""
    out: list = [None] * len(calls)
    errors: list = []

    def run(i: int) -> None:
        try:
            out[i] = calls[i]()
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return out


def scheduler_load(s: Stack) -> dict:
    (w,) = workers(s, "scheduler")
    return w.load


# -- what the adapters give ----------------------------------------------------------------------------------
def test_models_list_each_adapter_with_its_base_as_parent(lora):
    data = {m["id"]: m for m in httpx.get(f"{lora.base_url}/v1/models", timeout=10).json()["data"]}
    assert set(data) == {MODEL, "sql", "chat", "mlp", "kv"}
    for name in SPECS:
        card = data[name]
        assert card["parent"] == MODEL and card["object"] == "model" and card["state"] == "ready", card
        assert card["max_model_len"] == data[MODEL]["max_model_len"] and card["rank"] == SPECS[name]["r"]
    assert data["sql"]["targets"] == ["q_proj", "v_proj"] and data[MODEL]["parent"] is None
    model = client(lora, 1).models.retrieve("mlp")  # the other API process knows it too
    assert model.parent == MODEL and model.root.endswith("mlp")


@pytest.mark.parametrize("adapter", [None, *SPECS])
def test_greedy_output_equals_transformers_on_the_merged_model(lora, reference, adapter):
    for i, prompt in enumerate(PROMPTS):
        want = reference[(adapter, i)]
        assert generate(lora, adapter, prompt)["output_ids"] == want, (adapter, i)
        assert generate(lora, adapter, prompt, api=1, stream=True)["output_ids"] == want, (adapter, i)
    if adapter is not None:
        assert reference[(adapter, 1)] != reference[(None, 1)], "the adapter changes the output"


@pytest.mark.parametrize("adapter", list(SPECS))
def test_completions_and_chat_through_the_openai_client_stream_as_they_answer(lora, adapter):
    for prompt in PROMPTS[:2]:
        full = completion_text(lora, adapter, prompt, stream=False)
        assert completion_text(lora, adapter, prompt, stream=True, api=1) == full
        assert full == generate(lora, adapter, prompt)["text"]
        assert full != completion_text(lora, MODEL, prompt, stream=False)
    kw = dict(model=adapter, messages=[{"role": "user", "content": "Hello there"}], max_tokens=N, temperature=0)
    chat = client(lora).chat.completions.create(**kw)
    assert chat.model == adapter and chat.choices[0].message.content
    with httpx.stream("GET", f"{url(lora, 1)}/v1/requests/{chat.id}/stream", timeout=30) as resp:
        first = next(line for line in resp.iter_lines() if line.startswith("data: {"))
    assert json.loads(first[6:])["model"] == adapter, "a reattached stream names the adapter too"
    streamed = "".join(c.choices[0].delta.content or "" for c in client(lora, 1).chat.completions.create(
        stream=True, **kw) if c.choices)
    assert streamed == chat.choices[0].message.content


def test_sglang_lora_path_names_the_adapter(lora, reference):
    assert generate(lora, MODEL, PROMPTS[0], lora_path="kv")["output_ids"] == reference[("kv", 0)]
    resp = httpx.post(f"{lora.base_url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": PROMPTS[0], "max_tokens": N, "temperature": 0, "ignore_eos": True,
        "lora_path": "sql"})
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == generate(lora, "sql", PROMPTS[0])["text"]
    resp = httpx.post(f"{lora.base_url}/v1/completions", timeout=60, json={
        "model": "chat", "prompt": PROMPTS[0], "max_tokens": 2, "lora_path": "sql"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "lora_path"
    resp = httpx.post(f"{lora.base_url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "hi", "max_tokens": 2, "lora_request": {"lora_name": "sql"}})
    assert resp.status_code == 400 and "load_lora_adapter" in resp.json()["error"]["message"]


def test_the_base_and_three_adapters_together_give_each_alone(lora, reference):
    names = [None, "sql", "chat", "mlp"]
    calls = [lambda a=a, i=i, k=k: generate(lora, a, PROMPTS[i], api=(i + k) % 2)["output_ids"]
             for k, a in enumerate(names) for i in range(len(PROMPTS))]
    got = together(calls)
    want = [reference[(a, i)] for a in names for i in range(len(PROMPTS))]
    assert got == want


def test_more_adapters_in_use_than_slots_all_complete(lora, reference):
    before = scheduler_load(lora)
    names = ["kv", "sql", "chat", "mlp", None]  # 4 adapters, 3 slots
    calls = [lambda a=a, i=i: generate(lora, a, PROMPTS[i], api=i % 2)["output_ids"]
             for a in names for i in range(len(PROMPTS))] * 2
    got = together(calls)
    want = [reference[(a, i)] for a in names for i in range(len(PROMPTS))] * 2
    assert got == want
    after = wait_for(lambda: (ld := scheduler_load(lora))["lora_loads"] > before["lora_loads"] and ld, 10, 0.2)
    assert after["lora_evictions"] > before["lora_evictions"] and after["lora_resident"] <= SLOTS, after


# -- loading at run time -------------------------------------------------------------------------------------
def test_load_use_unload_and_reload_through_two_api_processes(lora, made, reference):
    assert load(lora, "late", made["chat"][0], api=1).status_code == 200
    assert generate(lora, "late", PROMPTS[1], api=0)["output_ids"] == reference[("chat", 1)]
    assert unload(lora, "late", api=0).status_code == 200
    for api in (0, 1):
        with pytest.raises(openai.NotFoundError) as err:
            client(lora, api).completions.create(model="late", prompt=PROMPTS[1], max_tokens=2)
        assert err.value.body["code"] == "model_not_found"
    assert unload(lora, "late", api=1).status_code == 404
    # Loaded again under the same name from other weights: served with them, not with the first ones' KV pages
    # or slot (the prompt's pages were cached under the first registration).
    assert load(lora, "late", made["chat-v2"][0], api=0).status_code == 200
    assert generate(lora, "late", PROMPTS[1], api=1)["output_ids"] == reference[("chat-v2", 1)]
    assert reference[("chat-v2", 1)] != reference[("chat", 1)]
    assert unload(lora, "late", api=1).status_code == 200
    wait_for(lambda: not any(a.startswith("late@") for a in scheduler_load(lora)["lora_adapters"]), 10, 0.2)


def test_an_unknown_adapter_is_a_404_in_openai_shape(lora):
    c = client(lora)
    with pytest.raises(openai.NotFoundError) as err:
        c.chat.completions.create(model="no-such-adapter", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    resp = httpx.post(f"{lora.base_url}/generate", json={"model": MODEL, "text": "hi", "lora_path": "nope"})
    assert resp.status_code == 404 and set(resp.json()["error"]) == {"message", "type", "param", "code"}
    assert resp.json()["error"]["param"] == "lora_path"
    assert httpx.get(f"{lora.base_url}/v1/models/no-such-adapter").status_code == 404


def _bad_folders(root: Path, made) -> dict[str, tuple[Path, str]]:
    """name -> (folder, what the 400 says)."""
    good = made["sql"][0]
    out = {}

    def copy(name: str) -> Path:
        folder = root / name
        folder.mkdir()
        for f in good.iterdir():
            (folder / f.name).write_bytes(f.read_bytes())
        return folder

    out["missing"] = (root / "nowhere", "no adapter folder")
    folder = copy("no-config")
    (folder / "adapter_config.json").unlink()
    out["no-config"] = (folder, "adapter_config.json is missing")
    folder = copy("no-weights")
    (folder / "adapter_model.safetensors").unlink()
    out["no-weights"] = (folder, "adapter_model.safetensors is missing")
    folder = copy("bad-json")
    (folder / "adapter_config.json").write_text("{not json")
    out["bad-json"] = (folder, "not JSON")
    folder = copy("too-high-rank")
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "r": 32}))
    out["too-high-rank"] = (folder, "rank 32 exceeds --max-lora-rank 16")
    folder = copy("unknown-target")
    (folder / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["embed_tokens"]}))
    out["unknown-target"] = (folder, "target_modules ['embed_tokens']")
    folder = copy("not-safetensors")
    (folder / "adapter_model.safetensors").write_bytes(b"\x00" * 4)
    out["not-safetensors"] = (folder, "not a safetensors file")
    folder = copy("wrong-shapes")
    config_r4 = {**config, "r": 4}  # the weights are rank 8
    (folder / "adapter_config.json").write_text(json.dumps(config_r4))
    out["wrong-shapes"] = (folder, "expected [4,")
    return out


def test_a_bad_folder_is_a_400_at_load_naming_its_field(lora, made, tmp_path):
    for name, (folder, says) in _bad_folders(tmp_path, made).items():
        resp = load(lora, f"bad-{name}", folder, api=len(name) % 2)
        assert resp.status_code == 400, (name, resp.text)
        err = resp.json()["error"]
        assert err["param"] == "lora_path" and says in err["message"], (name, err)
    assert {n for n in _names(lora) if n.startswith("bad-")} == set()
    for body, param in [({"lora_name": "x y", "lora_path": str(made["sql"][0])}, "lora_name"),
                        ({"lora_name": "a" * 129, "lora_path": str(made["sql"][0])}, "lora_name"),
                        ({"lora_name": "rel", "lora_path": "relative/path"}, "lora_path"),
                        ({"lora_name": "long", "lora_path": "/" + "p" * 1100}, "lora_path"),
                        ({"lora_name": MODEL, "lora_path": str(made["sql"][0])}, "lora_name"),
                        ({"lora_name": "sql", "lora_path": str(made["sql"][0])}, "lora_name"),
                        ({"lora_name": "s3", "lora_path": "s3://elsewhere/adapters/x"}, "lora_path"),
                        ({"lora_name": "x", "lora_path": "/x", "colour": 1}, "colour"),
                        ({"lora_name": "x", "lora_path": str(made["sql"][0]), "base_model_name": "m" * 129},
                         "base_model_name")]:
        resp = httpx.post(f"{lora.base_url}/v1/load_lora_adapter", json=body, timeout=30)
        assert resp.status_code == 400, (body, resp.text)
        assert resp.json()["error"]["param"] == param, (body, resp.text)
    resp = httpx.post(f"{lora.base_url}/v1/unload_lora_adapter", json={"lora_name": "a" * 129}, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "lora_name", resp.text
    resp = load(lora, "other", made["sql"][0], base_model_name="no-such-model")
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "base_model_name"
    # The scheduler never saw any of them and serves on.
    assert generate(lora, "sql", PROMPTS[0])["output_ids"]


def test_registrations_are_bounded(lora, made):
    registered = len(_names(lora)) - 1
    extra = [f"fill{k}" for k in range(8 - registered)]
    try:
        for name in extra:
            assert load(lora, name, made["kv"][0]).status_code == 200
        resp = load(lora, "one-too-many", made["kv"][0], api=1)
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "too_many_adapters", resp.text
    finally:
        for name in extra:
            unload(lora, name)
    assert load(lora, "one-too-many", made["kv"][0], api=1).status_code == 200
    assert unload(lora, "one-too-many").status_code == 200


# -- what operators see --------------------------------------------------------------------------------------
def test_adapter_state_in_the_heartbeat_metrics_and_inspect(lora):
    generate(lora, "sql", PROMPTS[0])
    # the next heartbeats say it (earlier tests' adapters may be resident already)
    load_ = wait_for(lambda: (ld := scheduler_load(lora))["lora_resident"]
                     and any(a.startswith("sql@") for a in ld["lora_adapters"]) and ld, 10, 0.2)
    assert load_["lora_slots"] == SLOTS and load_["lora_loads"] >= 1
    text = httpx.get(f"{lora.base_url}/metrics", timeout=10).text
    for metric in ("rsinfer_lora_slots", "rsinfer_lora_resident", "rsinfer_lora_loads_total",
                   "rsinfer_lora_evictions_total"):
        assert f"{metric}{{model=\"{MODEL}\"" in text, metric
    out = subprocess.run([sys.executable, "-m", "rsinfer.cli", "inspect", "--redis-url", lora.redis_url,
                          "--namespace", lora.namespace], capture_output=True, text=True, timeout=60,
                         env=lora.env())
    assert out.returncode == 0, out.stderr
    assert "ADAPTER" in out.stdout and "sql" in out.stdout and f"{MODEL}" in out.stdout


def test_an_adapter_from_the_object_store(lora, made, reference):
    folder = lora.store / "adapters" / "stored-mlp"
    shutil.copytree(made["mlp"][0], folder)
    resp = load(lora, "stored-mlp", f"file://{folder}", api=1)
    assert resp.status_code == 200, resp.text
    try:
        card = client(lora).models.retrieve("stored-mlp")
        assert card.root == "store:adapters/stored-mlp" and card.parent == MODEL
        assert generate(lora, "stored-mlp", PROMPTS[2])["output_ids"] == reference[("mlp", 2)]
        assert any((lora.store / ".cache").iterdir()), "the scheduler fetched it into its cache"
    finally:
        assert unload(lora, "stored-mlp").status_code == 200
    resp = load(lora, "stored-none", f"file://{lora.store}/adapters/none")
    assert resp.status_code == 400 and "adapter_config.json is missing" in resp.json()["error"]["message"]


def test_the_adapter_routes_need_the_api_key_when_one_is_set(lora, made):
    port = free_port()
    lora.start("api-keyed", "api", **{**lora.lora_env, "RSINFER_PORT": str(port), "RSINFER_API_KEY": KEY})
    base = f"http://127.0.0.1:{port}"
    try:
        lora.wait_until(lambda: api_ready(base), 60, "keyed api")
        body = {"lora_name": "keyed", "lora_path": str(made["kv"][0])}
        assert httpx.post(f"{base}/v1/load_lora_adapter", json=body).status_code == 401
        auth = {"Authorization": f"Bearer {KEY}"}
        assert httpx.post(f"{base}/v1/load_lora_adapter", json=body, headers=auth, timeout=30).status_code == 200
        assert httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "keyed"}).status_code == 401
        assert httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "keyed"}, headers=auth,
                          timeout=30).status_code == 200
    finally:
        lora.kill("api-keyed")


def test_a_key_allowed_the_base_model_does_not_reach_its_adapters(lora, tmp_path, random_model_dir):
    """An adapter is allowed by its own name in the key's `models`: neither `model: <adapter>` nor `model: <base>,
    lora_path: <adapter>` reaches it with a key that lists only the base (a name outside the policy is a 403
    whether or not it exists); a key that lists the adapter runs it, and with it alone not the base."""
    base_key, sql_key, admin_key = ("sk-" + name + "-" + "0" * 30 for name in ("base-only", "sql-only", "ops"))
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps([{"key": base_key, "tenant": "base-only", "models": [MODEL]},
                                {"key": sql_key, "tenant": "sql-only", "models": ["sql"]},
                                {"key": admin_key, "tenant": "ops", "admin": True}]))
    port = free_port()
    lora.start("api-tenants", "api", **{**lora.lora_env, "RSINFER_PORT": str(port),
                                        "RSINFER_API_KEYS_FILE": str(keys)})
    base = f"http://127.0.0.1:{port}"

    def post(path: str, key: str, body: dict) -> httpx.Response:
        return httpx.post(f"{base}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)

    gen = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": N, "temperature": 0, "ignore_eos": True}}
    completion = {"prompt": PROMPTS[0], "max_tokens": N, "temperature": 0, "ignore_eos": True}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        lora.wait_until(lambda: api_ready(base), 60, "api with tenants")
        assert post("/generate", base_key, {"model": MODEL, **gen}).status_code == 200
        for path, body in (("/generate", gen), ("/v1/completions", completion), ("/v1/chat/completions", chat)):
            for lora_path in ("sql", "no-such-adapter"):
                resp = post(path, base_key, {"model": MODEL, "lora_path": lora_path, **body})
                assert resp.status_code == 403, (path, lora_path, resp.text)
                assert resp.json()["error"]["param"] == "lora_path", (path, resp.text)
            resp = post(path, base_key, {"model": "sql", **body})
            assert resp.status_code == 403 and resp.json()["error"]["param"] == "model", (path, resp.text)
        for path in ("/tokenize", "/v1/embeddings"):
            body = {"model": "sql", "prompt": "hi"} if path == "/tokenize" else {"model": "sql", "input": "hi"}
            resp = post(path, base_key, body)
            assert resp.status_code == 403 and resp.json()["error"]["param"] == "model", (path, resp.text)
        ran = post("/generate", sql_key, {"model": "sql", **gen})
        assert ran.status_code == 200 and ran.json()["output_ids"] == generate(lora, "sql", PROMPTS[0])["output_ids"]
        resp = post("/generate", sql_key, {"model": MODEL, "lora_path": "sql", **gen})
        assert resp.status_code == 403 and resp.json()["error"]["param"] == "model", resp.text
        assert post("/tokenize", sql_key, {"model": "sql", "prompt": "hi"}).status_code == 200
        _models_show_paths_to_admins_only(base, {base_key: [MODEL], sql_key: ["sql"]}, admin_key, random_model_dir)
    finally:
        lora.kill("api-tenants")


def _models_show_paths_to_admins_only(base: str, keys: dict[str, list[str]], admin_key: str, model_dir) -> None:
    """`/v1/models` (and one model's card) name the models and adapters a tenant may use, never a server path
    (`root` is the card's own name); an admin's show the folders."""
    for key, names in keys.items():
        listed = httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        assert [(m["id"], m["root"]) for m in listed.json()["data"]] == [(n, n) for n in names], listed.text
        one = httpx.get(f"{base}/v1/models/{names[0]}", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        for text in (listed.text, one.text):
            assert "/" not in "".join(str(v) for m in json.loads(text).get("data", [json.loads(text)])
                                      for v in m.values()), text
        assert str(model_dir) not in listed.text + one.text
    admin = {m["id"]: m for m in httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {admin_key}"},
                                           timeout=10).json()["data"]}
    assert admin["sql"]["root"].endswith("/sql") and admin[MODEL]["root"] == str(model_dir)


def test_local_adapter_folders_load_only_from_lora_roots(lora, made, tmp_path_factory):
    """A load's `lora_path` outside --lora-roots (here pytest's temporary directory) is a 400 naming it that says
    nothing of the path (whether it exists, what it holds); inside, through `..` or a symlink out, the same."""
    root = tmp_path_factory.getbasetemp()
    link = tmp_path_factory.mktemp("links") / "etc"
    link.symlink_to("/etc")
    said = set()
    for path in ("/etc", "/etc/passwd", "/no/such/folder", f"{root}/../../etc", str(link), "file:///etc"):
        resp = load(lora, "outside", path)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "lora_path", (path, resp.text)
        said.add(resp.json()["error"]["message"])
    assert said == {f"lora_path must lie inside --lora-roots ({root})"}, said
    resp = load(lora, "inside", made["kv"][0], api=1)
    assert resp.status_code == 200, resp.text
    assert unload(lora, "inside").status_code == 200


def test_a_scheduler_killed_mid_generation_finishes_on_a_peer_with_the_same_text(lora):
    """Last in the module: the peer started here serves from then on. The frozen scheduler holds requests of
    three adapters and the base; the peer claims them, loads their adapters, resumes each from its reply stream."""
    bodies = [{"model": m or MODEL, "messages": [{"role": "user", "content": f"crash test {k}"}], "max_tokens": 120,
               "temperature": 0, "ignore_eos": True} for k, m in enumerate([None, "sql", "chat", "mlp"])]
    expected = texts_of(lora, bodies)
    [old] = live_names(lora, "scheduler")
    runs = [Streamer(lora.base_url, b) for b in bodies]
    wait_for(lambda: all(len(r.text) > 10 for r in runs), timeout=60)
    lora.procs[old].send_signal(signal.SIGSTOP)  # it holds every request and will never finish them
    lora.start("scheduler-peer", "scheduler", **lora.lora_env)
    wait_for(lambda: "scheduler-peer" in live_names(lora, "scheduler"), timeout=90)
    lora.kill(old)
    assert [r.result(90) for r in runs] == expected
    records = [lora.redis().hgetall(lora.keys.request(r.uid)) for r in runs]
    assert all(rec["scheduler"].startswith("scheduler-peer@") for rec in records), records
    def peer_load() -> dict:
        return next((w.load for w in workers(lora, "scheduler") if w.name == "scheduler-peer"), {})

    # the peer's heartbeats after its loads say it (its first one may come before them)
    wait_for(lambda: (ld := peer_load()).get("lora_loads", 0) >= 3
             and {a.split("@")[0] for a in ld.get("lora_adapters", [])} >= {"sql", "chat", "mlp"}, 10, 0.2)


def _rounds(s: Stack, names: list[str], rounds: int) -> list[str]:
    """Each adapter `rounds` times, in an order of no pattern (the same every run), one request at a time; the
    uids, in `_order(names, rounds)`."""
    uids = []
    for name in _order(names, rounds):
        resp = httpx.post(f"{s.base_url}/v1/completions", timeout=60, json={
            "model": name, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert resp.status_code == 200, resp.text
        uids.append(resp.json()["id"].removeprefix("cmpl-"))
    return uids


def _order(names: list[str], rounds: int) -> list[str]:
    import random

    order = names * rounds
    random.Random(23).shuffle(order)
    return order


def _loads(s: Stack) -> tuple[int, int]:
    loads = [w.load for w in workers(s, "scheduler")]
    return sum(ld["lora_loads"] for ld in loads), sum(ld["lora_evictions"] for ld in loads)


@pytest.mark.slow  # a stack of its own, with two schedulers (bench/lora_routing.py measures the same)
def test_adapter_aware_routing_sends_each_request_where_its_adapter_is_loaded(redis_server, demo_model_dir,
                                                                             tmp_path_factory, made):
    """2 schedulers of 2 slots, 4 adapters, requests for each in turn: routed, each adapter is loaded once, on one
    scheduler, and every later request lands there; from the shared stream (the same stack, its tokenizer
    restarted without --prefix-routing) whoever reads a request loads its adapter."""
    names = ["sql", "chat", "mlp", "kv"]
    modules = " ".join(f"{n}={made[n][0]}" for n in names)
    # A tokenizer counts an adapter it sent as held for a heartbeat TTL, until the scheduler's heartbeats say so:
    # LIFECYCLE_ENV's 2 s is shorter than an adapter's load on a busy machine (the request then took the shared
    # stream), and nothing here waits for a heartbeat to lapse.
    env = {**LIFECYCLE_ENV, "RSINFER_HEARTBEAT_TTL_S": "10", "RSINFER_MAX_LORAS": "2", "RSINFER_MAX_KV_TOKENS": "4096",
           "RSINFER_LORA_MODULES": modules, "RSINFER_LORA_ROOTS": str(tmp_path_factory.getbasetemp())}
    s = new_stack(redis_server, demo_model_dir, tmp_path_factory, "lroute")
    try:
        start_replicas(s, {"scheduler": 2}, apis=1, RSINFER_PREFIX_ROUTING="true", **env)
        wait_for(lambda: [w.load.get("routing_to") for w in workers(s, "tokenizer")] == [2], 60, 0.2)
        uids = _rounds(s, names, 4)
        routed_loads, routed_evictions = wait_for(lambda: (got := _loads(s))[0] >= 4 and got, 10, 0.2)
        records = [s.redis().hgetall(s.keys.request(u)) for u in uids]
        assert all("/" in rec["entry"] for rec in records), "each went to a scheduler's own stream"
        where = {}
        for name, rec in zip(_order(names, 4), records, strict=True):
            where.setdefault(name, set()).add(rec["scheduler"])
        assert all(len(on) == 1 for on in where.values()), where
        assert (routed_loads, routed_evictions) == (4, 0)
        s.kill("tokenizer1", signal.SIGTERM)
        s.start("tokenizer2", "tokenizer", **env)
        wait_for(lambda: "tokenizer2" in live_names(s, "tokenizer"), 60, 0.2)
        _rounds(s, names, 4)
        ended = time.time()  # what the schedulers' next heartbeats count
        wait_for(lambda: all(w.updated_at > ended for w in workers(s, "scheduler")), 10, 0.1)
        shared_loads, shared_evictions = _loads(s)
        print(f"\nLoRA loads for 16 requests of 4 adapters on 2 schedulers of 2 slots: routed {routed_loads} "
              f"(evictions {routed_evictions}), shared stream {shared_loads - routed_loads} "
              f"(evictions {shared_evictions - routed_evictions})")
    finally:
        s.stop()
