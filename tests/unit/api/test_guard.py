"""The API's guard: the bearer key, and /drain, which only the pod itself or a caller with the key may call."""

from __future__ import annotations

import httpx
import pytest

from services.api.app import create_app
from shared.settings import ApiSettings

pytestmark = pytest.mark.timeout(30)


async def _drain(api_key: str | None, client_ip: str, auth: str | None = None) -> httpx.Response:
    app = create_app(ApiSettings(redis_url="redis://127.0.0.1:1/0", api_key=api_key))
    transport = httpx.ASGITransport(app=app, client=(client_ip, 40000))
    headers = {"Authorization": f"Bearer {auth}"} if auth else {}
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
        return await client.get("/drain", headers=headers)


@pytest.mark.parametrize(("api_key", "client_ip", "auth", "status"), [
    (None, "10.1.2.3", None, 403),  # an open API: nobody on the network may take the pod out
    ("k", "10.1.2.3", None, 401),
    ("k", "10.1.2.3", "wrong", 401),
    ("k", "10.1.2.3", "k", 200),  # an operator with the key
    (None, "127.0.0.1", None, 200),  # the pod itself: its preStop hook runs `rsinfer drain` inside it
    ("k", "127.0.0.1", None, 200),
    ("k", "::1", None, 200),
])
async def test_only_the_pod_itself_or_a_keyed_caller_may_drain(api_key, client_ip, auth, status):
    resp = await _drain(api_key, client_ip, auth)
    assert resp.status_code == status, resp.text
    if status == 200:
        assert resp.json()["draining"] is True
    else:
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
