"""`/admin/webhooks`: endpoints, their delivery logs and the dead-letter list (fakeredis)."""

from __future__ import annotations

import base64
import time

import pytest

from workers.wire import webhooks as wire


def _create(client, **body):
    return client.post("/admin/webhooks", json={"url": "https://hooks.example.com/x", **body})


def test_create_shows_the_secret_once_and_listing_never(client) -> None:
    created = _create(client, events=["response.completed", "batch.expired"])
    assert created.status_code == 201
    body = created.get_json()
    assert body["url"] == "https://hooks.example.com/x"
    assert body["events"] == ["response.completed", "batch.expired"]
    assert body["secret"].startswith("whsec_")
    assert len(base64.b64decode(body["secret"].removeprefix("whsec_"))) == 32
    listed = client.get("/admin/webhooks").get_json()
    assert listed["object"] == "list" and [e["id"] for e in listed["data"]] == [body["id"]]
    assert "secret" not in listed["data"][0]
    assert body["secret"] not in client.get("/admin/webhooks").get_data(as_text=True)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"url": "ftp://x.example/", "events": ["response.completed"]}, "url"),
        ({"url": "not a url", "events": ["response.completed"]}, "url"),
        ({"url": "http:///nohost", "events": ["response.completed"]}, "url"),
        ({"url": "https://u:p@x.example/", "events": ["response.completed"]}, "url"),
        ({"url": 5, "events": ["response.completed"]}, "url"),
        ({"url": "https://x.example/", "events": []}, "events"),
        ({"url": "https://x.example/", "events": ["response.done"]}, "events"),
        ({"url": "https://x.example/", "events": "response.completed"}, "events"),
        ({"url": "https://x.example/", "events": ["batch.completed"], "extra": 1}, "extra"),
    ],
)
def test_bad_input_is_an_openai_shaped_400(client, body, param) -> None:
    response = client.post("/admin/webhooks", json=body)
    assert response.status_code == 400
    error = response.get_json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_delete_then_404(client) -> None:
    endpoint_id = _create(client, events=["batch.failed"]).get_json()["id"]
    deleted = client.delete(f"/admin/webhooks/{endpoint_id}")
    assert deleted.status_code == 200 and deleted.get_json()["deleted"] is True
    assert client.delete(f"/admin/webhooks/{endpoint_id}").status_code == 404
    assert client.get(f"/admin/webhooks/{endpoint_id}/deliveries").status_code == 404
    assert client.get("/admin/webhooks").get_json()["data"] == []


def test_delivery_log_and_dead_list(client, fake_redis) -> None:
    endpoint_id = _create(client, events=["response.failed"]).get_json()["id"]
    attempt = wire.DeliveryAttempt(
        "whd_1", "evt_1", "response.failed", 1, 500, "HTTP 500", 3.5, time.time()
    )
    wire.log_delivery(fake_redis, endpoint_id, attempt)
    [logged] = client.get(f"/admin/webhooks/{endpoint_id}/deliveries").get_json()["data"]
    assert logged["status"] == 500 and logged["error"] == "HTTP 500" and logged["attempt"] == 1
    assert client.get("/admin/webhooks/dead").get_json() == {"object": "list", "data": []}
    assert client.post("/admin/webhooks/dead/whd_nope/redeliver").status_code == 404
    assert client.post("/admin/webhooks/dead/a:b/redeliver").status_code == 404


def test_the_dashboard_has_a_webhooks_table_fed_by_the_admin_routes(client) -> None:
    page = client.get("/").get_data(as_text=True)
    assert '<tbody id="webhooks">' in page
    assert '"/admin/webhooks/" + e.id + "/deliveries"' in page and '"/admin/webhooks/dead"' in page
