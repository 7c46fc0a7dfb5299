"""Structured output end to end: the official `openai` client, a real server and a real
worker process running SmolLM2 (`smollm2_*` in tests/api/conftest.py). What the client gets
back parses and validates, greedy and sampled; a bad schema is a 400 before any job exists."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.api.conftest import SMOLLM2 as MODEL
from tests.workers.conftest import wait_for
from workers import keys

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "legs": {"type": "integer", "minimum": 0, "maximum": 8},
    },
    "required": ["name", "kind", "legs"],
    "additionalProperties": False,
}
PET_FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}}
ASK_PET = [{"role": "user", "content": "Describe a pet as JSON: its name, kind and legs."}]


def test_json_schema_greedy_and_five_seeds_validate(smollm2_oai) -> None:
    greedy = smollm2_oai.chat.completions.create(
        model=MODEL, messages=ASK_PET, response_format=PET_FORMAT, max_tokens=60, temperature=0
    )
    sampled = smollm2_oai.chat.completions.create(
        model=MODEL,
        messages=ASK_PET,
        response_format=PET_FORMAT,
        max_tokens=60,
        temperature=1.0,
        n=5,
        seed=7,
    )
    choices = greedy.choices + sampled.choices
    for choice in choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PET)
    assert len({c.message.content for c in sampled.choices}) > 1  # five seeds, not one


def test_json_object_and_its_stream_agree(smollm2_oai) -> None:
    messages = [{"role": "user", "content": "Give a JSON object with a city and its country."}]
    args = dict(model=MODEL, messages=messages, max_tokens=80, temperature=0)
    reply = smollm2_oai.chat.completions.create(response_format={"type": "json_object"}, **args)
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    stream = smollm2_oai.chat.completions.create(
        response_format={"type": "json_object"}, stream=True, **args
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == reply.choices[0].message.content


def test_completions_regex_and_lark_grammar(smollm2_oai) -> None:
    phone = smollm2_oai.completions.create(
        model=MODEL,
        prompt="Call me on my phone number,",
        max_tokens=20,
        temperature=1.0,
        seed=3,
        extra_body={"regex": r" [0-9]{3}-[0-9]{4}"},
    )
    assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", phone.choices[0].text)
    assert phone.choices[0].finish_reason == "stop"
    answer = smollm2_oai.completions.create(
        model=MODEL,
        prompt="Is the sky blue? Answer:",
        max_tokens=5,
        temperature=0,
        extra_body={"grammar": 'start: " yes" | " no"'},
    )
    assert answer.choices[0].text in (" yes", " no")


def test_an_async_job_returns_a_validating_result(smollm2_server) -> None:
    body = {
        "model": MODEL,
        "messages": ASK_PET,
        "response_format": PET_FORMAT,
        "max_tokens": 60,
        "temperature": 0,
    }
    job = httpx.post(
        f"{smollm2_server}/v1/jobs", json={"endpoint": "/v1/chat/completions", "body": body}
    ).json()

    def result() -> dict | None:
        view = httpx.get(f"{smollm2_server}/v1/jobs/{job['id']}").json()
        return view.get("result") if view["status"] in ("finished", "failed") else None

    done = wait_for(result, 60, "the job to finish")
    jsonschema.validate(json.loads(done["choices"][0]["message"]["content"]), PET)


def test_an_invalid_schema_is_a_400_with_llguidances_message_and_no_job(
    smollm2_oai, smollm2_redis
) -> None:
    before = set(smollm2_redis.keys(keys.job("*")))
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wrong"}}}
    with pytest.raises(openai.BadRequestError) as raised:
        smollm2_oai.chat.completions.create(
            model=MODEL, messages=ASK_PET, response_format=bad, max_tokens=5
        )
    error = raised.value.body
    assert error["param"] == "response_format"
    assert error["message"] == "invalid JSON schema: Invalid type: wrong"
    with pytest.raises(openai.BadRequestError, match="unclosed group"):
        smollm2_oai.completions.create(model=MODEL, prompt="x", extra_body={"regex": "(a"})
    assert set(smollm2_redis.keys(keys.job("*"))) == before
