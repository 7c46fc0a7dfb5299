"""A request that is the user's mistake is a 400 at submission, never a failed job: the API
reads the real models' tokenizers and chat templates (never their weights) and finds what
the engine would refuse before anything is queued."""

from __future__ import annotations

import json

import fakeredis
import pytest

from api.app import create_app
from api.batches.lines import validate_lines
from api.model_texts import ModelTexts
from tests.api.fake_worker import FakeWorker
from workers import keys

SMOL, GEMMA = "smollm2-135m-instruct", "gemma-3-270m"


@pytest.fixture
def client(fake_redis: fakeredis.FakeRedis):
    FakeWorker(fake_redis, models=(SMOL, GEMMA), context_length=8192).register()
    return create_app({"TESTING": True, "REDIS_CLIENT": fake_redis}).test_client()


def chat(model: str, content: str, **fields) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], **fields}


def refused(response, param: str) -> str:
    assert response.status_code == 400, response.get_json()
    error = response.get_json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    return error["message"]


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        (  # 9000 tokens after the template: past the 8192 the worker serves
            "/v1/chat/completions",
            chat(SMOL, "hello " * 9000, max_tokens=10),
            "messages",
            "maximum context length is 8192 tokens",
        ),
        (
            "/v1/completions",
            {"model": SMOL, "prompt": "hi", "logit_bias": {"60000": 5}},
            "logit_bias",
            "out of range for a vocabulary of 49152 tokens",
        ),
        (
            "/v1/completions",
            {"model": SMOL, "prompt": [1, 2, 49152]},
            "prompt",
            "token id 49152 is out of range",
        ),
        ("/v1/chat/completions", chat(GEMMA, "hi"), "messages", "chat template"),
    ],
)
def test_user_mistakes_are_refused_before_anything_is_queued(
    client, fake_redis, path, body, param, words
) -> None:
    for headers in ({}, {"Prefer": "respond-async"}):
        assert words in refused(client.post(path, json=body, headers=headers), param)
    job = client.post("/v1/jobs", json={"endpoint": path, "body": body})
    assert words in refused(job, param)
    assert not fake_redis.keys(keys.job("*"))  # no job: nothing to fail
    assert fake_redis.hget(keys.METRIC_JOBS, "failed") is None


def test_a_request_the_engine_takes_is_queued(client, fake_redis) -> None:
    for body in (chat(SMOL, "hello " * 100, max_tokens=10), {"model": GEMMA, "prompt": [2, 9]}):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        response = client.post(path, json=body, headers={"Prefer": "respond-async"})
        assert response.status_code == 202, response.get_json()


def test_a_batch_line_with_a_mistake_is_a_line_error() -> None:
    lines = [
        {"custom_id": m, "method": "POST", "url": "/v1/chat/completions", "body": chat(m, "hi")}
        for m in (GEMMA, SMOL)
    ]
    content = "\n".join(json.dumps(line) for line in lines).encode()
    models = {GEMMA: {"context_length": 8192}, SMOL: {"context_length": 8192}}
    valid, invalid = validate_lines(content, "/v1/chat/completions", models, ModelTexts())
    assert [line.line for line in valid] == [2]
    assert [line.line for line in invalid] == [1] and "chat template" in invalid[0].message
