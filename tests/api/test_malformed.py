"""docs/faults.md M rows: malformed input gets the right status in OpenAI's error shape, and the
app keeps serving. Unit tier: Flask test client over fakeredis, a registered idle worker."""

from __future__ import annotations

import json
from typing import Any

import pytest

from workers import keys

GOOD = {"model": "tiny", "prompt": "hello"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}]}
JSON = "application/json"


def completion(**fields: Any) -> dict[str, Any]:
    return {**GOOD, **fields}


def without(key: str) -> dict[str, Any]:
    return {k: v for k, v in GOOD.items() if k != key}


def deep(depth: int) -> str:
    return '{"model": "tiny", "prompt": ' + "[" * depth + "]" * depth + "}"


# (id, path, raw body or JSON-able value, content type, expected status, expected param)
ROWS: list[tuple[str, str, Any, str, int, str | None]] = [
    ("1-truncated", "/v1/completions", b'{"prompt": "hi"', JSON, 400, None),
    ("2-null", "/v1/completions", b"null", JSON, 400, None),
    ("2-number", "/v1/completions", b"42", JSON, 400, None),
    ("2-string", "/v1/completions", b'"str"', JSON, 400, None),
    ("2-array", "/v1/completions", b"[1]", JSON, 400, None),
    ("3-empty", "/v1/completions", b"", JSON, 400, None),
    ("4-text-plain", "/v1/completions", json.dumps(GOOD).encode(), "text/plain", 415, None),
    (
        "4-form",
        "/v1/completions",
        b"model=tiny&prompt=hi",
        "application/x-www-form-urlencoded",
        415,
        None,
    ),
    ("5-missing-prompt", "/v1/completions", without("prompt"), JSON, 400, "prompt"),
    ("5-missing-model", "/v1/completions", without("model"), JSON, 400, "model"),
    ("6-empty-prompt", "/v1/completions", completion(prompt=""), JSON, 400, "prompt"),
    ("6-blank-prompt", "/v1/completions", completion(prompt=" \n\t"), JSON, 400, "prompt"),
    ("7-prompt-int", "/v1/completions", completion(prompt=123), JSON, 400, "prompt"),
    ("7-prompt-object", "/v1/completions", completion(prompt={}), JSON, 400, "prompt"),
    ("7-prompt-empty-list", "/v1/completions", completion(prompt=[]), JSON, 400, "prompt"),
    ("8-max-tokens-0", "/v1/completions", completion(max_tokens=0), JSON, 400, "max_tokens"),
    ("8-max-tokens-neg", "/v1/completions", completion(max_tokens=-1), JSON, 400, "max_tokens"),
    ("9-max-tokens-str", "/v1/completions", completion(max_tokens="10"), JSON, 400, "max_tokens"),
    ("9-max-tokens-float", "/v1/completions", completion(max_tokens=10.5), JSON, 400, "max_tokens"),
    ("9-max-tokens-bool", "/v1/completions", completion(max_tokens=True), JSON, 400, "max_tokens"),
    (
        "10-max-tokens-huge",
        "/v1/completions",
        completion(max_tokens=10**12),
        JSON,
        400,
        "max_tokens",
    ),
    (
        "11-max-tokens-over-context",
        "/v1/completions",
        completion(max_tokens=4096),
        JSON,
        400,
        "max_tokens",
    ),
    ("13-temperature-neg", "/v1/completions", completion(temperature=-1), JSON, 400, "temperature"),
    (
        "13-temperature-nan",
        "/v1/completions",
        b'{"model": "tiny", "prompt": "x", "temperature": NaN}',
        JSON,
        400,
        None,
    ),
    (
        "13-temperature-inf",
        "/v1/completions",
        b'{"model": "tiny", "prompt": "x", "temperature": Infinity}',
        JSON,
        400,
        None,
    ),
    (
        "13-temperature-1e999",
        "/v1/completions",
        b'{"model": "tiny", "prompt": "x", "temperature": 1e999}',
        JSON,
        400,
        "temperature",
    ),
    ("14-top-p-0", "/v1/completions", completion(top_p=0), JSON, 400, "top_p"),
    ("14-top-p-1.5", "/v1/completions", completion(top_p=1.5), JSON, 400, "top_p"),
    ("14-top-k-neg", "/v1/completions", completion(top_k=-5), JSON, 400, "top_k"),
    ("15-n-huge", "/v1/completions", completion(n=100000), JSON, 400, "n"),
    ("15-best-of", "/v1/completions", completion(best_of=5), JSON, 400, "best_of"),
    ("16-stop-many", "/v1/completions", completion(stop=["x"] * 1000), JSON, 400, "stop"),
    ("16-stop-five", "/v1/completions", completion(stop=list("abcde")), JSON, 400, "stop"),
    ("16-stop-long", "/v1/completions", completion(stop="x" * 100_000), JSON, 400, "stop"),
    ("17-unknown-model", "/v1/completions", completion(model="nope"), JSON, 404, "model"),
    ("18-unknown-field", "/v1/completions", completion(max_token=5), JSON, 400, "max_token"),
    (
        "19-lone-surrogate",
        "/v1/completions",
        b'{"model": "tiny", "prompt": "\\ud800"}',
        JSON,
        400,
        None,
    ),
    (
        "19-invalid-utf8",
        "/v1/completions",
        b'{"model": "tiny", "prompt": "\xff\xfe"}',
        JSON,
        400,
        None,
    ),
    ("21-deep-nesting", "/v1/completions", deep(100_000).encode(), JSON, 400, None),
    (
        "invalid-json-schema",
        "/v1/completions",
        completion(json_schema={"type": "object", "properties": {"a": {"type": "wrong"}}}),
        JSON,
        400,
        "json_schema",
    ),
    ("invalid-regex", "/v1/completions", completion(regex="(a"), JSON, 400, "regex"),
    ("invalid-grammar", "/v1/completions", completion(grammar="start: x"), JSON, 400, "grammar"),
    (
        "two-constraints",
        "/v1/completions",
        completion(regex="a+", grammar='start: "a"'),
        JSON,
        400,
        "grammar",
    ),
    (
        "malformed-lora",
        "/v1/completions",
        completion(lora=[{"name": "a", "scale": "1"}]),
        JSON,
        400,
        "lora",
    ),
    (
        "chat-response-format-type",
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "xml"}},
        JSON,
        400,
        "response_format.type",
    ),
    (
        "chat-json-schema-format-without-schema",
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "json_schema"}},
        JSON,
        400,
        "response_format",
    ),
    (
        "chat-json-schema-invalid",
        "/v1/chat/completions",
        {
            **CHAT,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "a"}},
            },
        },
        JSON,
        400,
        "response_format",
    ),
    (
        "chat-tool-without-function",
        "/v1/chat/completions",
        {**CHAT, "tools": [{"type": "function"}]},
        JSON,
        400,
        "tools[0].function",
    ),
    (
        "chat-tool-bad-name",
        "/v1/chat/completions",
        {**CHAT, "tools": [{"type": "function", "function": {"name": "a b"}}]},
        JSON,
        400,
        "tools",
    ),
    (
        "chat-tool-bad-parameters",
        "/v1/chat/completions",
        {
            **CHAT,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 1}}}],
        },
        JSON,
        400,
        "tools",
    ),
    (
        "chat-tool-choice-unknown-function",
        "/v1/chat/completions",
        {
            **CHAT,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        JSON,
        400,
        "tool_choice",
    ),
    (
        "chat-tool-choice-required-without-tools",
        "/v1/chat/completions",
        {**CHAT, "tool_choice": "required"},
        JSON,
        400,
        "tool_choice",
    ),
    (
        "chat-tools-and-json-format",
        "/v1/chat/completions",
        {
            **CHAT,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "response_format": {"type": "json_object"},
        },
        JSON,
        400,
        "response_format",
    ),
    (
        "chat-tool-message-without-id",
        "/v1/chat/completions",
        {**CHAT, "messages": [*CHAT["messages"], {"role": "tool", "content": "4"}]},
        JSON,
        400,
        "messages[1]",
    ),
    (
        "chat-user-message-without-content",
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user"}]},
        JSON,
        400,
        "messages[0]",
    ),
    (
        "chat-functions-deprecated",
        "/v1/chat/completions",
        {**CHAT, "functions": [{"name": "f"}]},
        JSON,
        400,
        "functions",
    ),
    ("chat-no-messages", "/v1/chat/completions", {**CHAT, "messages": []}, JSON, 400, "messages"),
    (
        "chat-bad-role",
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "wizard", "content": "x"}]},
        JSON,
        400,
        "messages[0].role",
    ),
    (
        "chat-image-part",
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        JSON,
        400,
        "messages[0].content",
    ),
    (
        "chat-stream-options-without-stream",
        "/v1/chat/completions",
        {**CHAT, "stream_options": {"include_usage": True}},
        JSON,
        400,
        "stream_options",
    ),
    (
        "chat-top-logprobs-range",
        "/v1/chat/completions",
        {**CHAT, "logprobs": True, "top_logprobs": 50},
        JSON,
        400,
        "top_logprobs",
    ),
    ("embeddings-empty", "/v1/embeddings", {"model": "tiny", "input": ""}, JSON, 400, "input"),
    (
        "embeddings-token-ids",
        "/v1/embeddings",
        {"model": "tiny", "input": [[1, 2], [-1]]},  # token ids are ids: never negative
        JSON,
        400,
        "input",
    ),
    (
        "embeddings-format",
        "/v1/embeddings",
        {"model": "tiny", "input": "x", "encoding_format": "hex"},
        JSON,
        400,
        "encoding_format",
    ),
    (
        "jobs-bad-endpoint",
        "/v1/jobs",
        {"endpoint": "/v1/nope", "body": GOOD},
        JSON,
        400,
        "endpoint",
    ),
    (
        "jobs-body-not-object",
        "/v1/jobs",
        {"endpoint": "/v1/completions", "body": "x"},
        JSON,
        400,
        "body",
    ),
    (
        "jobs-invalid-inner",
        "/v1/jobs",
        {"endpoint": "/v1/completions", "body": without("prompt")},
        JSON,
        400,
        "prompt",
    ),
]


def assert_openai_error(response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.get_data(as_text=True)
    assert response.mimetype == "application/json"
    body = response.get_json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in error["message"]
    return error


@pytest.mark.parametrize(
    ("path", "body", "content_type", "status", "param"),
    [row[1:] for row in ROWS],
    ids=[row[0] for row in ROWS],
)
def test_malformed_input(client, path, body, content_type, status, param) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = client.post(path, data=data, content_type=content_type)
    error = assert_openai_error(response, status)
    if param is not None:
        assert error["param"] == param
    assert client.get("/health").status_code == 200  # still serving


def test_every_row_left_nothing_queued(client, fake_redis) -> None:
    for _, path, body, content_type, _, _ in ROWS:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        client.post(path, data=data, content_type=content_type)
    assert fake_redis.llen(f"rq:queue:{keys.queue_name('tiny')}") == 0
    assert not fake_redis.keys(keys.job("*"))


def test_messages_name_the_field_and_value(client) -> None:
    error = assert_openai_error(client.post("/v1/completions", json=completion(top_p=1.5)), 400)
    assert error["message"] == "top_p must be in (0, 1], got 1.5."
    error = assert_openai_error(
        client.post("/v1/completions", json=completion(max_tokens=True)), 400
    )
    assert error["message"] == "max_tokens must be an integer, got True."
    error = assert_openai_error(client.post("/v1/completions", json=completion(max_token=5)), 400)
    assert error["message"] == "Unrecognized request argument supplied: max_token"


@pytest.mark.parametrize("prompt", ["a\x00b", "line\r\nforged: yes", "tab\there"])
def test_control_characters_are_text(client, fake_redis, prompt) -> None:
    """Row 20: NUL/CR/LF in a prompt are accepted as text (async, so no worker is needed)."""
    response = client.post(
        "/v1/completions", json=completion(prompt=prompt), headers={"Prefer": "respond-async"}
    )
    assert response.status_code == 202
    stored = json.loads(fake_redis.hget(keys.job(response.get_json()["id"]), "request"))
    assert stored["prompt"] == prompt


def test_unsafe_request_id_is_replaced(client) -> None:
    """Row 20: an X-Request-Id that could forge log lines is never echoed."""
    response = client.get("/health", headers={"X-Request-Id": "abc\x00def"})
    assert response.headers["X-Request-Id"] != "abc\x00def"
    assert client.get("/health", headers={"X-Request-Id": "req-1"}).headers["X-Request-Id"] == (
        "req-1"
    )


def test_body_too_large_with_content_length(client) -> None:
    """Row 22 (with Content-Length); the chunked case runs against a real server."""
    big = json.dumps(completion(prompt="x" * (2 * 1024 * 1024))).encode()
    error = assert_openai_error(client.post("/v1/completions", data=big, content_type=JSON), 413)
    assert "1048576" in error["message"]


def test_wrong_method_and_unknown_path(client) -> None:
    """Row 25."""
    response = client.get("/v1/completions")
    assert_openai_error(response, 405)
    assert "POST" in response.headers["Allow"]
    assert_openai_error(client.get("/v1/nothing-here"), 404)


@pytest.mark.parametrize("job_id", ["a:b", "x" * 10_000, "a.b", "%2e%2e"])
def test_invalid_job_ids_never_reach_redis(client, job_id) -> None:
    """Row 26: ids outside RQ's alphabet are refused (400) before any Redis lookup."""
    for method, path in (
        ("get", f"/v1/jobs/{job_id}"),
        ("post", f"/v1/jobs/{job_id}/cancel"),
        ("get", f"/v1/jobs/{job_id}/events"),
    ):
        assert_openai_error(getattr(client, method)(path), 400)


def test_path_traversal_job_id_is_not_routed(client) -> None:
    assert_openai_error(client.get("/v1/jobs/../../x"), 404)


def test_unknown_job_and_garbage_event_id(client) -> None:
    """Rows 27-28."""
    assert_openai_error(client.get("/v1/jobs/doesnotexist"), 404)
    assert_openai_error(client.post("/v1/jobs/doesnotexist/cancel"), 404)
    job = client.post("/v1/completions", json=GOOD, headers={"Prefer": "respond-async"})
    job_id = job.get_json()["id"]
    response = client.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "garbage"})
    assert_openai_error(response, 400)
    assert_openai_error(client.get(f"/v1/jobs/{job_id}/events?after=1-2-3"), 400)


def test_unexpected_exception_is_a_500_without_internals(app) -> None:
    def boom():
        raise RuntimeError("secret internal detail")

    app.add_url_rule("/boom", view_func=boom)
    error = assert_openai_error(app.test_client().get("/boom"), 500)
    assert "secret" not in error["message"]
    assert error["type"] == "server_error"


def test_broker_down_is_503_with_retry_after(registered) -> None:
    """docs/faults.md F7: Redis unreachable -> 503 + Retry-After, not 500."""
    from api.app import create_app

    app = create_app({"TESTING": True, "REDIS_URL": "redis://127.0.0.1:1/0"})
    response = app.test_client().post("/v1/completions", json=GOOD)
    error = assert_openai_error(response, 503)
    assert response.headers["Retry-After"]
    assert error["code"] == "broker_down"


@pytest.mark.parametrize("value", ["1", 1.5, True, None, [0], 2**31, -(2**31) - 1])
@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/embeddings"])
def test_a_priority_that_is_not_a_32_bit_integer_is_a_400(client, endpoint, value):
    body = completion(priority=value)
    if endpoint == "/v1/embeddings":
        body = {"model": body["model"], "input": "hi", "priority": value}
    error = assert_openai_error(client.post(endpoint, json=body), 400)
    assert error["param"] == "priority" and "priority" in error["message"]


@pytest.mark.parametrize("value", [-(2**31), -3, 0, 7, 2**31 - 1])
def test_an_integer_priority_is_kept_on_the_job(client, value):
    job = client.post(
        "/v1/completions", json=completion(priority=value), headers={"Prefer": "respond-async"}
    )
    assert job.status_code == 202, job.get_json()
    shown = client.get(f"/v1/jobs/{job.get_json()['id']}").get_json()
    assert (shown["priority"], shown["status"]) == (value, "queued")
