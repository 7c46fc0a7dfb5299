"""What clients written for OpenAI send and expect, on real Redis with the fake worker:
`models.retrieve`, every field of OpenAI's request types, token-id prompts, and the
async jobs' own shapes (the `{endpoint, body}` envelope and `GET /v1/jobs`)."""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.integration

ASYNC = {"Prefer": "respond-async"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_models_retrieve_through_the_openai_client(server, worker) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=10)
    try:
        model = client.models.retrieve("tiny")
        assert model.id == "tiny" and model.object == "model" and model.owned_by == "llmq"
        assert model.model_dump()["max_model_len"] == 2048
        with pytest.raises(openai.NotFoundError) as raised:
            client.models.retrieve("no-such-model")
        assert raised.value.body["code"] == "model_not_found"
    finally:
        client.close()


def test_openai_only_fields_are_accepted_and_metadata_is_shown_on_the_job(
    live_client, worker
) -> None:
    openai_only = {
        "store": True,
        "metadata": {"team": "search"},
        "service_tier": "auto",
        "reasoning_effort": "low",
        "verbosity": "low",
        "modalities": ["text"],
        "prediction": {"type": "content", "content": "t0"},
        "prompt_cache_key": "k",
        "safety_identifier": "user-1",
        "user": "user-1",
        "parallel_tool_calls": True,
    }
    response = live_client.post("/v1/chat/completions", json={**CHAT, **openai_only})
    assert response.status_code == 200, response.get_json()
    assert response.get_json()["choices"][0]["message"]["content"] == "t0 t1 "
    job = live_client.post("/v1/chat/completions", json={**CHAT, **openai_only}, headers=ASYNC)
    view = live_client.get(f"/v1/jobs/{job.get_json()['id']}").get_json()
    assert view["metadata"] == {"team": "search"}
    # a name OpenAI does not have is still a typo
    typo = live_client.post("/v1/chat/completions", json={**CHAT, "max_token": 2})
    assert typo.status_code == 400 and typo.get_json()["error"]["param"] == "max_token"
    audio = live_client.post("/v1/chat/completions", json={**CHAT, "modalities": ["audio"]})
    assert audio.status_code == 400 and audio.get_json()["error"]["param"] == "modalities"


@pytest.mark.parametrize(("prompt", "choices"), [([1, 2, 3], 1), ([[1, 2], [3]], 2)])
def test_prompts_given_as_token_ids(live_client, worker, prompt, choices) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
    response = live_client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.get_json()
    assert [c["text"] for c in response.get_json()["choices"]] == ["t0 t1 "] * choices


def test_a_plain_body_posted_as_a_job_is_told_the_envelope(live_client) -> None:
    response = live_client.post("/v1/jobs", json=CHAT)
    error = response.get_json()["error"]
    assert response.status_code == 400
    assert '{"endpoint": "/v1/chat/completions", "body": {...}}' in error["message"]


def test_jobs_are_listed_newest_first_in_pages_and_by_status(live_client, worker) -> None:
    worker.paused.set()  # they stay queued until the listing has seen them
    ids = []
    for _ in range(3):
        job = live_client.post("/v1/jobs", json={"endpoint": "/v1/chat/completions", "body": CHAT})
        ids.append(job.get_json()["id"])
    page = live_client.get("/v1/jobs?limit=2").get_json()
    assert page["object"] == "list" and page["has_more"]
    assert [j["id"] for j in page["data"]] == ids[::-1][:2] == [page["first_id"], page["last_id"]]
    rest = live_client.get(f"/v1/jobs?limit=2&after={page['last_id']}").get_json()
    assert [j["id"] for j in rest["data"]] == [ids[0]] and not rest["has_more"]
    assert len(live_client.get("/v1/jobs?status=queued").get_json()["data"]) == 3
    assert live_client.get("/v1/jobs?status=finished").get_json()["data"] == []
    bad = live_client.get("/v1/jobs?status=done")
    assert bad.status_code == 400 and bad.get_json()["error"]["param"] == "status"
