"""Batch input lines are validated one by one, exactly like live requests (docs/faults.md M29)."""

from __future__ import annotations

import json
from typing import Any

from api.batches.lines import numbered_lines, validate_lines
from workers.wire.defaults import MAX_LINE_BYTES
from workers.wire.job import CHAT_COMPLETIONS, COMPLETIONS

MODELS = {"tiny": {"context_length": 256}}


def line(custom_id: Any = "a", url: str = CHAT_COMPLETIONS, **body: Any) -> dict[str, Any]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]} | body
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def jsonl(*items: Any) -> bytes:
    return b"".join((i if isinstance(i, bytes) else json.dumps(i).encode()) + b"\n" for i in items)


def check(*items: Any, endpoint: str = CHAT_COMPLETIONS) -> tuple[list, dict[int, tuple]]:
    valid, invalid = validate_lines(jsonl(*items), endpoint, MODELS)
    return valid, {bad.line: (bad.custom_id, bad.code, bad.message) for bad in invalid}


def test_a_valid_line_keeps_its_number_custom_id_and_normalised_request() -> None:
    valid, invalid = check(line("x", max_completion_tokens=5, stop="END"))
    assert invalid == {}
    (only,) = valid
    assert (only.line, only.custom_id, only.model) == (1, "x", "tiny")
    assert only.request["max_tokens"] == 5 and only.request["stop"] == ["END"]
    assert json.loads(only.to_json())["request"] == only.request


def test_each_kind_of_bad_line_gets_its_own_error_and_the_rest_still_run() -> None:
    valid, errors = check(
        line("ok"),
        b"{not json",
        {"method": "POST", "url": CHAT_COMPLETIONS, "body": {}},
        line("ok"),
        line("m", url=COMPLETIONS),
        {**line("g"), "method": "GET"},
        line("t", top_p=1.5),
        line("u", model="nope"),
        line("s", stream=True),
        {**line("f"), "extra": 1},
        [1, 2],
        line("c", max_tokens=300),
        line("last"),
    )
    assert [v.custom_id for v in valid] == ["ok", "last"]
    assert errors[2][1] == "invalid_json_line"
    assert errors[3][:2] == (None, "missing_custom_id")
    assert errors[4][:2] == ("ok", "duplicate_custom_id")
    assert errors[5][:2] == ("m", "mismatched_url") and COMPLETIONS in errors[5][2]
    assert errors[6][:2] == ("g", "invalid_method")
    assert errors[7] == ("t", "invalid_request", "top_p must be in (0, 1], got 1.5.")
    assert errors[8][:2] == ("u", "model_not_found")
    assert errors[9][:2] == ("s", "invalid_request") and "stream" in errors[9][2]
    assert errors[10][:2] == ("f", "invalid_request") and "extra" in errors[10][2]
    assert errors[11][:2] == (None, "invalid_json_line") and "array" in errors[11][2]
    assert errors[12][:2] == ("c", "invalid_request") and "context length" in errors[12][2]


def test_unsupported_features_and_unknown_body_fields_are_line_errors() -> None:
    _, errors = check(line("a", functions=[{"name": "f"}]), line("b", max_token=3))
    assert errors[1][1] == "unsupported"
    assert errors[2][2] == "Unrecognized request argument supplied: max_token"


def test_bom_blank_lines_and_crlf_are_not_requests() -> None:
    content = b"\xef\xbb\xbf" + jsonl(line("a")).replace(b"\n", b"\r\n") + b"\n   \n"
    content += jsonl(line("b"))
    assert [n for n, _ in numbered_lines(content)] == [1, 4]
    valid, invalid = validate_lines(content, CHAT_COMPLETIONS, MODELS)
    assert [(v.line, v.custom_id) for v in valid] == [(1, "a"), (4, "b")] and not invalid


def test_bad_bytes_and_overlong_lines_are_line_errors() -> None:
    long = json.dumps(line("long", user="x" * 10)).replace("x" * 10, "x" * MAX_LINE_BYTES)
    _, errors = check(b'{"custom_id": "\xff"}', long.encode(), line("fine"))
    assert errors[1][1] == "invalid_json_line" and "UTF-8" in errors[1][2]
    assert errors[2][1] == "line_too_long"
    assert set(errors) == {1, 2}


def test_strict_json_rules_of_the_live_api_apply_to_lines() -> None:
    _, errors = check(
        b'{"custom_id": "n", "method": "POST", "url": "/v1/chat/completions", "body": NaN}',
        b"[" * 100 + b"]" * 100,
        line(""),
        line(123),
    )
    assert errors[1][1] == "invalid_json_line" and "NaN" in errors[1][2]
    assert errors[2][1] == "invalid_json_line" and "nested" in errors[2][2]
    assert errors[3][1] == errors[4][1] == "missing_custom_id"


def test_embeddings_and_completions_lines() -> None:
    item = {"custom_id": "e", "method": "POST", "url": "/v1/embeddings"}
    valid, _ = check({**item, "body": {"model": "tiny", "input": ["a"]}}, endpoint="/v1/embeddings")
    assert valid[0].request["input"] == ["a"]
    item = {"custom_id": "c", "method": "POST", "url": COMPLETIONS}
    _, errors = check({**item, "body": {"model": "tiny", "prompt": ""}}, endpoint=COMPLETIONS)
    assert errors[1][1] == "invalid_request" and "prompt" in errors[1][2]


def test_a_line_with_a_schema_carries_its_constraint_and_a_bad_schema_is_a_line_error() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}}}
    bad = {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "nope"}}}
    valid, errors = check(line("good", response_format=fmt), line("bad", response_format=bad))
    (good,) = valid
    assert good.spec["constraint"] == {
        "kind": "json_schema",
        "value": {"type": "object"},
        "param": "response_format",
    }
    assert errors[2] == ("bad", "invalid_request", "invalid JSON schema: Invalid type: nope")
