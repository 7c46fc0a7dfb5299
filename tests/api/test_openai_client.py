"""The official `openai` client against a real HTTP server (werkzeug in a thread, and
gunicorn as `llmq api` runs it), with the fake worker playing the worker's part."""

from __future__ import annotations

import time

import openai
import pytest

from tests.api.conftest import hang_up_after
from workers import keys

pytestmark = pytest.mark.integration


def test_chat_completion(oai, worker) -> None:
    response = oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, seed=1
    )
    assert response.choices[0].message.content == "t0 t1 t2 "
    assert response.choices[0].finish_reason == "length"
    assert response.usage.total_tokens == 8


def test_chat_stream_with_usage(oai, worker) -> None:
    stream = oai.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "t0 t1 t2 t3 "
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4


def test_completion_and_stream(oai, worker) -> None:
    assert oai.completions.create(model="tiny", prompt="x", max_tokens=2).choices[0].text == (
        "t0 t1 "
    )
    stream = oai.completions.create(model="tiny", prompt="x", max_tokens=2, stream=True)
    assert "".join(c.choices[0].text for c in stream) == "t0 t1 "


def test_embeddings(oai, worker) -> None:
    for extra in ({"encoding_format": "float"}, {}):  # by default the client asks for base64
        response = oai.embeddings.create(model="tiny", input=["a", "b"], **extra)
        assert [round(x, 3) for x in response.data[1].embedding] == [0.6, 0.8, 0.0]


def test_models_and_errors(oai, worker) -> None:
    assert [m.id for m in oai.models.list()] == ["tiny"]
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="top_p"):
        oai.completions.create(model="tiny", prompt="x", top_p=1.5)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        oai.completions.create(model="tiny", prompt="toolong")


def test_extension_fields_through_extra_body(oai, worker, real_redis) -> None:
    response = oai.completions.create(
        model="tiny", prompt="x", max_tokens=1, extra_body={"top_k": 5, "min_p": 0.1}
    )
    job_id = response.id.removeprefix("cmpl-")
    request = real_redis.hget(keys.job(job_id), "request").decode()
    assert '"top_k": 5' in request and '"min_p": 0.1' in request


# ---------------------------------------------------------------- under gunicorn


def test_under_gunicorn(gunicorn, worker, real_redis) -> None:
    """Auth, streaming and disconnect detection with gunicorn's gthread worker."""
    with (
        openai.OpenAI(base_url=f"{gunicorn}/v1", api_key="wrong", max_retries=0) as wrong,
        pytest.raises(openai.AuthenticationError),
    ):
        wrong.models.list()
    client = openai.OpenAI(base_url=f"{gunicorn}/v1", api_key="sk-test", max_retries=0)
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream) == "t0 t1 t2 "

    body = {"model": "tiny", "prompt": "slow", "max_tokens": 400, "stream": True}
    hang_up_after(gunicorn, body, timeout=10, headers={"Authorization": "Bearer sk-test"})
    job_id = worker.processed[-1]
    deadline = time.monotonic() + 3
    while real_redis.hget(keys.job(job_id), "status") != b"cancelled":
        assert time.monotonic() < deadline, "the job was not cancelled after the disconnect"
        time.sleep(0.05)
    client.close()
