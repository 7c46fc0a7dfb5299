"""Admin, health, readiness and metrics (unit tier: fakeredis)."""

from __future__ import annotations

import json
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.api.fake_worker import FakeWorker
from workers import keys
from workers.wire.histograms import TTFT_BUCKETS, histogram_fields

GOOD = {"model": "tiny", "prompt": "hello"}
ASYNC = {"Prefer": "respond-async"}


def test_health_and_ready(client) -> None:
    assert client.get("/health").get_json() == {"status": "ok"}
    ready = client.get("/ready")
    assert ready.status_code == 200
    assert ready.get_json()["models"] == ["tiny"]


def test_not_ready_without_a_live_worker(client, fake_redis, registered) -> None:
    registered.info.heartbeat = time.time() - 60
    fake_redis.hset(keys.worker(registered.info.name), mapping=registered.info.to_hash())
    response = client.get("/ready")
    assert response.status_code == 503
    assert response.headers["Retry-After"]


def test_ready_only_once_a_worker_has_a_model_loaded(client, fake_redis, registered) -> None:
    """A worker still loading is alive but not ready: a first request would wait for the load."""
    other = FakeWorker(fake_redis, name="fake-2", models=("tiny", "big"))
    other.info.pool = {"tiny": {"state": "loading"}, "big": {"state": "loading"}}
    registered.info.pool = {"tiny": {"state": "loading"}}
    for worker in (registered, other):
        worker.register()
    response = client.get("/ready")
    assert response.status_code == 503 and response.headers["Retry-After"]
    error = response.get_json()["error"]
    assert error["code"] == "model_loading" and "loading: big, tiny" in error["message"]
    other.info.pool["big"] = {"state": "ready"}
    other.register()
    ready = client.get("/ready").get_json()
    assert ready.pop("broker") == {  # fakeredis has no INFO: its role is unknown
        "master": ready_broker_address(fake_redis),
        "role": "unknown",
        "replicas": 0,
        "sentinel": False,
    }
    assert ready == {"status": "ready", "workers": 1, "models": ["big"]}


def ready_broker_address(conn) -> str:
    kwargs = conn.connection_pool.connection_kwargs
    return f"{kwargs['host']}:{kwargs['port']}"


def test_admin_jobs_lists_what_workers_run_without_prompts(client, fake_redis, registered) -> None:
    job_id = client.post("/v1/completions", json=GOOD, headers=ASYNC).get_json()["id"]
    assert client.get("/admin/jobs").get_json()["data"] == []  # queued: no worker runs it
    registered.info.current_jobs = [job_id, "ended-and-expired"]
    registered.register()
    fake_redis.hset(keys.job(job_id), "completion_tokens", "7")
    response = client.get("/admin/jobs")
    [job] = response.get_json()["data"]
    assert (job["id"], job["model"], job["worker"]) == (job_id, "tiny", "fake-1")
    assert job["completion_tokens"] == 7 and job["created_at"] <= time.time()
    assert GOOD["prompt"] not in response.get_data(as_text=True)


def test_models_say_whether_they_take_chat(client, fake_redis) -> None:
    fake_redis.hset(keys.MODELS, "tiny", json.dumps({"chat_template": False}))
    [model] = client.get("/v1/models").get_json()["data"]
    assert model["id"] == "tiny" and model["chat_template"] is False


def test_dashboard_and_its_favicon(client) -> None:
    page = client.get("/").get_data(as_text=True)
    assert 'const DEFAULT_MODEL = "smollm2-135m-instruct"' in page
    assert 'rel="icon"' in page
    icon = client.get("/favicon.ico")
    assert icon.status_code == 200 and icon.mimetype == "image/svg+xml"
    assert icon.get_data().startswith(b"<svg")
    icon.close()


def test_admin_workers_models_queues(client) -> None:
    client.post("/v1/completions", json=GOOD, headers=ASYNC)
    workers = client.get("/admin/workers").get_json()["data"]
    assert workers[0]["name"] == "fake-1" and workers[0]["alive"] is True
    models = client.get("/admin/models").get_json()["data"]
    assert models[0]["id"] == "tiny" and models[0]["serving"] == ["fake-1"]
    queues = client.get("/admin/queues").get_json()["data"]
    assert queues == [
        {
            "name": keys.queue_name("tiny"),
            "priority": 0,
            "queued": 1,
            "started": 0,
            "finished": 0,
            "failed": 0,
            "deferred": 0,
            "scheduled": 0,
            "canceled": 0,
        }
    ]


@pytest.mark.parametrize("op", ["load", "unload"])
def test_load_unload_sends_a_command(client, fake_redis, op) -> None:
    response = client.post(f"/admin/models/{op}", json={"model": "tiny"})
    assert response.status_code == 202
    assert response.get_json()["workers"] == ["fake-1"]
    command = json.loads(fake_redis.rpop(keys.worker_commands("fake-1")))
    assert command == {"op": op, "model": "tiny"}


@pytest.mark.parametrize(
    "model",
    [
        "../../etc/passwd",
        "/etc/passwd",
        "file:///etc/passwd",
        "http://169.254.169.254/",
        "model.bin/../x",
        "",
        5,
    ],
)
def test_load_refuses_paths_and_urls(client, fake_redis, model) -> None:
    """Row 30: only registry ids are forwarded; nothing reaches a worker."""
    response = client.post("/admin/models/load", json={"model": model})
    assert response.status_code in (400, 404)
    assert fake_redis.llen(keys.worker_commands("fake-1")) == 0


def test_loras_list_is_empty_without_adapters(client) -> None:
    response = client.get("/admin/loras")
    assert response.status_code == 200 and response.get_json()["data"] == []


def test_metrics_render_worker_counters(client, fake_redis) -> None:
    fake_redis.hincrby(keys.METRIC_TOKENS_GENERATED, "tiny", 42)
    for value in (0.03, 0.2, 100.0):
        bucket, count, total = histogram_fields("tiny", value, TTFT_BUCKETS)
        fake_redis.hincrby(keys.METRIC_TTFT, bucket, 1)
        fake_redis.hincrby(keys.METRIC_TTFT, count, 1)
        fake_redis.hincrbyfloat(keys.METRIC_TTFT, total, value)
    fake_redis.hset(keys.METRIC_TOKENS_PER_SECOND, "fake-1", 12.5)
    fake_redis.hset(
        keys.METRIC_PREFIX_CACHE, mapping={"tiny|hit_tokens": 3, "tiny|prompt_tokens": 4}
    )
    client.post("/v1/completions", json=GOOD, headers=ASYNC)
    text = client.get("/metrics").get_data(as_text=True)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("llmq_tokens_generated_total", (("model", "tiny"),))] == 42
    assert (
        samples[("llmq_time_to_first_token_seconds_bucket", (("le", "0.05"), ("model", "tiny")))]
        == 1
    )
    assert (
        samples[("llmq_time_to_first_token_seconds_bucket", (("le", "0.25"), ("model", "tiny")))]
        == 2
    )
    assert (
        samples[("llmq_time_to_first_token_seconds_bucket", (("le", "+Inf"), ("model", "tiny")))]
        == 3
    )
    assert samples[("llmq_time_to_first_token_seconds_count", (("model", "tiny"),))] == 3
    assert samples[("llmq_tokens_per_second", (("worker", "fake-1"),))] == 12.5
    assert samples[("llmq_prefix_cache_hit_ratio", (("model", "tiny"),))] == 0.75
    assert samples[("llmq_queue_depth", (("queue", keys.queue_name("tiny")),))] == 1
    assert samples[("llmq_jobs_total", (("state", "queued"),))] == 1
    assert samples[("llmq_workers_live", ())] == 1
    key = (
        "llmq_http_requests_total",
        (("method", "POST"), ("route", "/v1/completions"), ("status", "202")),
    )
    assert samples[key] == 1


def test_models_lists_published_and_served(client, fake_redis) -> None:
    FakeWorker(fake_redis, name="fake-2", models=("other",)).register()
    fake_redis.hset(keys.MODELS, "cold", json.dumps({}))
    data = client.get("/v1/models").get_json()
    assert data["object"] == "list"
    assert {m["id"]: m["ready"] for m in data["data"]} == {
        "cold": False,
        "other": True,
        "tiny": True,
    }
    assert all(m["object"] == "model" and m["owned_by"] == "llmq" for m in data["data"])


def test_known_model_without_live_worker_is_503(client, fake_redis) -> None:
    fake_redis.hset(keys.MODELS, "cold", json.dumps({}))
    response = client.post("/v1/completions", json={**GOOD, "model": "cold"})
    assert response.status_code == 503
    assert response.headers["Retry-After"]
    assert response.get_json()["error"]["code"] == "no_worker"


def test_dashboard_page(client) -> None:
    response = client.get("/")
    assert response.status_code == 200
    assert b"Playground" in response.data and b"/v1/chat/completions" in response.data
