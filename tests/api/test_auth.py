"""docs/faults.md M23-M24: bearer keys on /v1, the admin key (or loopback) on /admin."""

from __future__ import annotations

import pytest

from api.app import create_app

GOOD = {"model": "tiny", "prompt": "hello"}


@pytest.fixture
def keyed(fake_redis, registered):
    app = create_app(
        {
            "TESTING": True,
            "REDIS_CLIENT": fake_redis,
            "API_KEYS": ("sk-user",),
            "ADMIN_KEY": "sk-admin",
        }
    )
    return app.test_client()


@pytest.mark.parametrize(
    "header",
    [None, "Bearer wrong", "Basic dXNlcjpwYXNz", "Bearer", "sk-user"],
    ids=["missing", "wrong", "basic", "empty-bearer", "no-scheme"],
)
def test_v1_needs_a_valid_bearer_key(keyed, header) -> None:
    headers = {"Authorization": header} if header else {}
    for response in (
        keyed.post("/v1/completions", json=GOOD, headers=headers),
        keyed.get("/v1/models", headers=headers),
        keyed.get("/v1/jobs/abc", headers=headers),
    ):
        assert response.status_code == 401
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
        assert response.get_json()["error"]["type"] == "authentication_error"
        assert "sk-user" not in response.get_data(as_text=True)


def test_v1_accepts_the_key(keyed) -> None:
    response = keyed.get("/v1/models", headers={"Authorization": "Bearer sk-user"})
    assert response.status_code == 200
    assert [m["id"] for m in response.get_json()["data"]] == ["tiny"]


def test_health_and_dashboard_need_no_key(keyed) -> None:
    assert keyed.get("/health").status_code == 200
    assert keyed.get("/").status_code == 200


def test_user_key_on_admin_is_forbidden(keyed) -> None:
    response = keyed.get("/admin/workers", headers={"Authorization": "Bearer sk-user"})
    assert response.status_code == 403
    assert response.get_json()["error"]["type"] == "permission_error"


def test_admin_needs_the_admin_key(keyed) -> None:
    assert keyed.get("/admin/workers").status_code == 401
    assert keyed.get("/admin/workers", headers={"Authorization": "Bearer nope"}).status_code == 401
    ok = keyed.get("/admin/workers", headers={"Authorization": "Bearer sk-admin"})
    assert ok.status_code == 200


def test_admin_key_is_not_a_user_key(keyed) -> None:
    response = keyed.get("/v1/models", headers={"Authorization": "Bearer sk-admin"})
    assert response.status_code == 401


def test_without_admin_key_admin_is_loopback_only(client) -> None:
    assert client.get("/admin/workers").status_code == 200  # test client is 127.0.0.1
    remote = client.get("/admin/workers", environ_base={"REMOTE_ADDR": "10.1.2.3"})
    assert remote.status_code == 403
    v6 = client.get("/admin/workers", environ_base={"REMOTE_ADDR": "::1"})
    assert v6.status_code == 200


def test_no_keys_configured_means_open_v1(client) -> None:
    assert client.get("/v1/models").status_code == 200
