"""OpenAI's Responses API through the official `openai` client against a real HTTP server
over real Redis, with the fake worker playing the worker's part (tests/api/fake_worker.py:
tokens "t0 ", "t1 ", ...; "slow" in the prompt waits between tokens; "callfn" calls the
first tool)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from openai.types.responses import Response

from workers import keys
from workers.wire.webhooks import NOTIFY_FIELD, NOTIFY_RESPONSE

pytestmark = pytest.mark.integration


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def _record_request(real_redis, response_id: str) -> dict:
    return json.loads(real_redis.hget(keys.job(response_id), "request"))


def _wait_status(oai, response_id: str, statuses: set[str], seconds: float = 10) -> Response:
    deadline = time.monotonic() + seconds
    while True:
        response = oai.responses.retrieve(response_id)
        if response.status in statuses:
            return response
        assert time.monotonic() < deadline, f"still {response.status}"
        time.sleep(0.05)


def test_create_answers_a_response(oai, worker, real_redis) -> None:
    response = oai.responses.create(
        model="tiny",
        input="hi",
        instructions="Be brief.",
        max_output_tokens=3,
        metadata={"k": "v"},
        temperature=0,
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == "t0 t1 t2 "
    assert response.status == "incomplete"  # the fake worker always stops at max_tokens
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == 5 and response.usage.output_tokens == 3
    assert response.usage.input_tokens_details.cached_tokens == 0
    assert (response.instructions, response.metadata, response.temperature) == (
        "Be brief.",
        {"k": "v"},
        0,
    )
    assert response.service_tier == "default" and response.store is True
    assert oai.responses.retrieve(response.id).model_dump() == response.model_dump()
    assert _record_request(real_redis, response.id)["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    # a response that is not background notifies nobody, as at OpenAI
    assert real_redis.hget(keys.job(response.id), NOTIFY_FIELD) is None
    assert response.id.encode() not in _outbox_ids(real_redis)
    # the job system still sees it as a job
    assert httpx.get(f"{oai.base_url}jobs/{response.id}").json()["status"] == "finished"


def test_stream_sends_openais_events(oai, worker) -> None:
    stream = oai.responses.create(model="tiny", input="hi", max_output_tokens=2, stream=True)
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert events[6].text == "t0 t1 " and events[-1].response.output_text == "t0 t1 "


def _outbox_ids(conn) -> list[bytes]:
    return [fields[b"id"] for _, fields in conn.xrange(keys.WEBHOOK_OUTBOX)]


def test_background_answers_at_once_then_polls_to_the_end(oai, worker, real_redis) -> None:
    worker.paused.set()
    response = oai.responses.create(model="tiny", input="hi", max_output_tokens=2, background=True)
    assert response.status == "queued" and response.background is True
    worker.paused.clear()
    done = _wait_status(oai, response.id, {"completed", "incomplete"})
    assert done.output_text == "t0 t1 " and done.status == "incomplete"
    assert done.completed_at is None  # OpenAI sets it only for a completed response
    # its end is in the webhooks' outbox (workers/wire/webhooks.py), written with its end
    assert real_redis.hget(keys.job(response.id), NOTIFY_FIELD) == NOTIFY_RESPONSE.encode()
    outbox = [fields for _, fields in real_redis.xrange(keys.WEBHOOK_OUTBOX)]
    # with the response's final status, the status the API shows (one derivation)
    entry = {b"kind": b"response", b"id": response.id.encode(), b"status": b"finished"}
    assert {**entry, b"response_status": done.status.encode()} in outbox


def test_cancel_a_background_response(oai, worker, real_redis) -> None:
    response = oai.responses.create(
        model="tiny", input="slow", max_output_tokens=400, background=True
    )
    _wait_status(oai, response.id, {"in_progress"})
    with pytest.raises(openai.BadRequestError) as caught:  # its output is not known yet
        oai.responses.create(model="tiny", input="x", previous_response_id=response.id)
    assert caught.value.body["code"] == "previous_response_in_progress"
    cancelled = oai.responses.cancel(response.id)
    assert cancelled.status == "cancelled"
    assert oai.responses.retrieve(response.id).status == "cancelled"
    assert real_redis.hget(keys.job(response.id), "status") == b"cancelled"
    done = oai.responses.create(model="tiny", input="hi", max_output_tokens=1)
    with pytest.raises(openai.BadRequestError, match="background"):
        oai.responses.cancel(done.id)  # OpenAI cancels only background responses


def test_delete_then_404(oai, worker, real_redis) -> None:
    response = oai.responses.create(model="tiny", input="hi", max_output_tokens=1)
    oai.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.delete(response.id)
    assert not real_redis.exists(keys.job(response.id), keys.job_events(response.id))


def test_input_items_and_previous_response_id(oai, worker, real_redis) -> None:
    first = oai.responses.create(
        model="tiny",
        input=[
            {"role": "user", "content": "one"},
            {"role": "user", "content": [{"type": "input_text", "text": "two"}]},
        ],
        instructions="first rules",
        max_output_tokens=1,
    )
    items = oai.responses.input_items.list(first.id)
    assert [i.content[0].text for i in items.data] == ["two", "one"]  # newest first
    assert items.first_id == items.data[0].id and items.has_more is False
    page = oai.responses.input_items.list(first.id, order="asc", limit=1)
    assert [i.content[0].text for i in page.data] == ["one"] and page.has_more
    rest = oai.responses.input_items.list(first.id, order="asc", after=page.last_id)
    assert [i.content[0].text for i in rest.data] == ["two"]

    second = oai.responses.create(
        model="tiny",
        input="three",
        previous_response_id=first.id,
        instructions="second rules",
        max_output_tokens=1,
    )
    assert second.previous_response_id == first.id
    assert _record_request(real_redis, second.id)["messages"] == [
        {"role": "system", "content": "second rules"},  # instructions are not carried over
        {"role": "user", "content": "one"},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "t0 "},
        {"role": "user", "content": "three"},
    ]
    third = oai.responses.create(
        model="tiny", input="four", previous_response_id=second.id, max_output_tokens=1
    )
    messages = _record_request(real_redis, third.id)["messages"]
    assert [m["content"] for m in messages] == ["one", "two", "t0 ", "three", "t0 ", "four"]
    listed = oai.responses.input_items.list(third.id, order="asc")
    assert [i.type for i in listed.data] == ["message"] * 6


def test_store_false_is_not_kept_for_later(oai, worker, real_redis) -> None:
    response = oai.responses.create(model="tiny", input="hi", max_output_tokens=1, store=False)
    assert response.output_text == "t0 " and response.store is False
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(response.id)
    with pytest.raises(openai.BadRequestError, match="not found") as caught:
        oai.responses.create(model="tiny", input="x", previous_response_id=response.id)
    assert caught.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError, match="store"):
        oai.responses.create(model="tiny", input="x", background=True, store=False)
    # its record and stream, which hold the text, go soon instead of after a day
    args = {"model": "tiny", "input": "hi", "max_output_tokens": 1, "store": False}
    streamed = list(oai.responses.create(stream=True, **args))
    for ended in (response.id, streamed[-1].response.id):
        assert 0 < real_redis.ttl(keys.job(ended)) <= 60
        assert 0 < real_redis.ttl(keys.job_events(ended)) <= 60


def test_tools_answer_with_a_function_call_and_take_its_output(oai, worker, real_redis) -> None:
    response = oai.responses.create(
        model="tiny", input="callfn please", tools=[WEATHER], tool_choice="required"
    )
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.status == "completed"
    assert response.tools[0].name == "get_weather" and response.tool_choice == "required"
    stream = oai.responses.create(model="tiny", input="callfn", tools=[WEATHER], stream=True)
    events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == call.arguments
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[0].call_id.startswith("call_")

    answer = oai.responses.create(
        model="tiny",
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=[WEATHER],
        max_output_tokens=1,
    )
    messages = _record_request(real_redis, answer.id)["messages"]
    assert messages[-2]["tool_calls"][0]["id"] == call.call_id
    assert messages[-1] == {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}


def test_text_format_json_schema_reaches_the_chat_request(oai, worker, real_redis) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    fmt = {"type": "json_schema", "name": "count", "schema": schema, "strict": True}
    response = oai.responses.create(
        model="tiny", input="hi", text={"format": fmt}, max_output_tokens=1
    )
    assert response.text.format.type == "json_schema" and response.text.format.name == "count"
    assert _record_request(real_redis, response.id)["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "count", "schema": schema, "strict": True},
    }
    with pytest.raises(openai.BadRequestError) as caught:
        bad = {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}
        oai.responses.create(model="tiny", input="hi", text={"format": bad})
    assert caught.value.body["param"].startswith("text.format")


def test_service_tiers_map_to_priorities_and_flex_is_refused_when_busy(
    oai, worker, real_redis, live_app
) -> None:
    urgent = oai.responses.create(
        model="tiny", input="hi", max_output_tokens=1, service_tier="priority"
    )
    assert urgent.service_tier == "priority"
    assert real_redis.hget(keys.job(urgent.id), "priority") == b"-1"
    auto = oai.responses.create(model="tiny", input="hi", max_output_tokens=1, service_tier="auto")
    assert auto.service_tier == "default"
    assert real_redis.hget(keys.job(auto.id), "priority") == b"0"
    flex = oai.responses.create(model="tiny", input="hi", max_output_tokens=1, service_tier="flex")
    assert flex.service_tier == "flex" and real_redis.hget(keys.job(flex.id), "priority") == b"1"

    live_app.config["FLEX_MAX_QUEUE"] = 2
    worker.paused.set()
    for _ in range(2):
        oai.responses.create(model="tiny", input="hi", background=True)
    with pytest.raises(openai.RateLimitError) as caught:
        oai.responses.create(model="tiny", input="hi", background=True, service_tier="flex")
    assert caught.value.body["code"] == "flex_queue_full"
    assert caught.value.response.headers["Retry-After"] == "2"
    # the other tiers still get in
    last = oai.responses.create(model="tiny", input="hi", background=True, service_tier="default")
    worker.paused.clear()
    _wait_status(oai, last.id, {"incomplete"})


def test_what_llmq_does_not_do_is_a_400_naming_it(oai, worker) -> None:
    cases = [
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"truncation": "auto"}, "truncation"),
        ({"extra_body": {"conversation": "conv_1"}}, "conversation"),
    ]
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            oai.responses.create(model="tiny", input="hi", **fields)
        assert caught.value.body["param"] == param
        assert caught.value.body["type"] == "invalid_request_error"


def test_retrieve_streams_from_starting_after_during_and_after_the_run(oai, worker) -> None:
    response = oai.responses.create(
        model="tiny", input="slow", max_output_tokens=30, background=True
    )
    seen: list = []
    early = threading.Thread(
        target=lambda: seen.extend(oai.responses.retrieve(response.id, stream=True))
    )
    early.start()
    # a reader that joins mid-run from N, and one that resumes after the end
    _wait_status(oai, response.id, {"in_progress"})
    time.sleep(0.3)
    middle = list(oai.responses.retrieve(response.id, stream=True, starting_after=5))
    early.join(20)
    done = oai.responses.retrieve(response.id)
    assert done.status == "incomplete" and done.output_text.count("t") == 30
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    whole = [e.model_dump() for e in seen]
    assert [e.model_dump() for e in middle] == whole[6:]
    for n in (-1, 0, 17, len(whole) - 2, len(whole) - 1):
        after = list(oai.responses.retrieve(response.id, stream=True, starting_after=n))
        assert [e.model_dump() for e in after] == whole[n + 1 :]
    assert seen[-1].response.output_text == done.output_text


def test_a_foreground_stream_that_disconnects_cancels_a_background_one_does_not(
    server, worker, real_redis
) -> None:
    def open_and_leave(background: bool) -> str:
        body = {
            "model": "tiny",
            "input": "slow",
            "max_output_tokens": 400,
            "stream": True,
            "background": background,
        }
        with httpx.stream("POST", f"{server}/v1/responses", json=body, timeout=10) as reply:
            for line in reply.iter_lines():
                if line.startswith("data:") and "output_text.delta" in line:
                    return json.loads(line[5:])["item_id"].split("_")[1]
        raise AssertionError("no delta")

    foreground = "resp_" + open_and_leave(False)
    background = "resp_" + open_and_leave(True)
    deadline = time.monotonic() + 5
    while real_redis.hget(keys.job(foreground), "status") != b"cancelled":
        assert time.monotonic() < deadline, "the foreground response was not cancelled"
        time.sleep(0.05)
    assert real_redis.hget(keys.job(background), "status") == b"started"
    httpx.post(f"{server}/v1/responses/{background}/cancel", timeout=10)
    assert real_redis.hget(keys.job(background), "status") == b"cancelled"
