"""The API's guard, and draining: no HTTP request takes a pod out of service, whoever sends it (the preStop hook
drains through the pod-local control socket, services/api/edge/admin.py; tests/e2e/test_shutdown.py)."""

from __future__ import annotations

import httpx
import pytest

from services.api.edge.app import create_app
from shared.settings import ApiSettings

pytestmark = pytest.mark.timeout(30)

KEY, USER, ADMIN = "sk-guard-" + "k" * 24, "sk-user-" + "0" * 24, "sk-admin-" + "0" * 24


@pytest.mark.parametrize(("api_key", "client_ip", "auth"), [
    (None, "10.1.2.3", None),
    (KEY, "10.1.2.3", KEY),  # a client with the key
    (None, "127.0.0.1", None),  # a reverse proxy on the same host: every caller is loopback
    (KEY, "127.0.0.1", KEY),
    (KEY, "::1", KEY),
])
@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_no_http_request_drains_the_pod(api_key, client_ip, auth, method):
    guard = create_app(ApiSettings(redis_url="redis://127.0.0.1:1/0", api_key=api_key))
    transport = httpx.ASGITransport(app=guard, client=(client_ip, 40000))
    headers = {"Authorization": f"Bearer {auth}"} if auth else {}
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
        for path in ("/drain", "/drain?wait=5", "/admin/drain"):
            resp = await client.request(method, path, headers=headers)
            assert resp.status_code in (404, 405), (path, resp.status_code, resp.text)
    assert guard.service.draining is False


async def test_the_key_guards_everything_but_the_probes():
    guard = create_app(ApiSettings(redis_url="redis://127.0.0.1:1/0", api_key=KEY))
    transport = httpx.ASGITransport(app=guard, client=("127.0.0.1", 40000))
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
        assert (await client.get("/v1/models")).status_code == 401
        assert (await client.get("/health")).status_code == 200


async def test_named_keys_guard_the_routes_and_admin_alone_reaches_the_operator_endpoints(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(f"- {{key: {USER}, tenant: users}}\n- {{key: {ADMIN}, tenant: ops, admin: true}}\n")
    for metrics_open in (True, False):
        guard = create_app(ApiSettings(redis_url="redis://127.0.0.1:1/0", api_keys_file=str(path),
                                       metrics_open=metrics_open))
        transport = httpx.ASGITransport(app=guard, client=("127.0.0.1", 40000))
        user, admin = {"Authorization": f"Bearer {USER}"}, {"Authorization": f"Bearer {ADMIN}"}
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            assert (await client.get("/v1/models")).status_code == 401
            basic = {"Authorization": f"Basic {USER}"}
            assert (await client.get("/v1/models", headers=basic)).status_code == 401
            assert (await client.get("/health")).status_code == 200
            for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
                refused = await client.post(route, headers=user, json={})
                assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_required"
                assert (await client.post(route, headers=admin, json={})).status_code == 400  # past the guard
            metrics = await client.get("/metrics", headers={})
            assert metrics.status_code == (200 if metrics_open else 401)
            if not metrics_open:
                assert (await client.get("/metrics", headers=user)).status_code == 403
                assert (await client.get("/metrics", headers=admin)).status_code == 200


async def test_the_messages_routes_answer_in_anthropic_s_shape_and_take_x_api_key():
    """/v1/messages (services/api/messages_api/): the key as `x-api-key` too; every refusal, the guard's own (401,
    413) as the routes' (400, and Redis out of reach: Anthropic's 529), in Anthropic's shape; OpenAI's routes keep
    theirs."""
    guard = create_app(ApiSettings(redis_url="redis://127.0.0.1:1/0", api_key=KEY, max_body_bytes=4096))
    transport = httpx.ASGITransport(app=guard, client=("127.0.0.1", 40000))
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]}
    keyed = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            refused = await client.post(path, json=body)
            assert refused.status_code == 401
            assert refused.json() == {"type": "error", "error": {"type": "authentication_error",
                                                                 "message": "invalid or missing API key"}}
        bad = await client.post("/v1/messages", headers=keyed, json={**body, "max_tokens": 0})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        assert "max_tokens" in bad.json()["error"]["message"]
        big = await client.post("/v1/messages", headers=keyed, json={**body, "system": "x" * 5000})
        assert big.status_code == 413 and big.json()["error"]["type"] == "request_too_large"
        down = await client.post("/v1/messages", headers={"Authorization": f"Bearer {KEY}"}, json=body)
        assert down.status_code == 529 and down.json()["error"]["type"] == "overloaded_error"
        assert down.headers["retry-after"] == "1"
        assert (await client.post("/v1/chat/completions", json={})).json()["error"]["code"] == "invalid_api_key"
