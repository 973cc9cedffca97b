"""HTTP edge headers: the bearer scheme is case-insensitive, and a 429 says when to retry."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.config import load_settings
from server.engine.engine import Overloaded

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def client():
    app = create_app(load_settings(api_key=KEY), load_in_background=True)

    @app.get("/overloaded-for-test")
    async def overloaded():
        raise Overloaded("2 requests are already queued or running")

    return TestClient(app)  # no lifespan: the model never loads, so an accepted key gets 503 from /info


@pytest.mark.parametrize("header", [f"Bearer {KEY}", f"bearer {KEY}", f"BEARER {KEY}", f"BeArEr  {KEY}"])
def test_bearer_scheme_is_case_insensitive(client, header):
    assert client.get("/info", headers={"Authorization": header}).status_code == 503  # past the key check


@pytest.mark.parametrize("header", [None, f"Basic {KEY}", f"Bearer {KEY.upper()}", "Bearer", f"Bearer{KEY}",
                                    f"{KEY}", "bearer wrong"])
def test_a_wrong_scheme_or_key_is_401(client, header):
    r = client.get("/info", headers={"Authorization": header} if header else {})
    assert r.status_code == 401 and r.json()["error_type"] == "authentication"
    assert r.headers["www-authenticate"] == "Bearer"


def test_429_carries_retry_after(client):
    r = client.get("/overloaded-for-test", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 429 and r.json()["error_type"] == "overloaded"
    assert int(r.headers["retry-after"]) >= 1
