"""A response's stream events derived from its job's events (api/responses/events.py) and
the Response object rendered from its record (workers/wire/responses_api.py); no Redis.
Every event and object is parsed by the official client's own types."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from api.responses.events import ResponseEvents, response_events
from api.responses.requests import messages
from workers.wire import responses_api as wire
from workers.wire.errors import cancelled_error, error_body
from workers.wire.events import StreamDone, StreamError, StreamToken, decode, encode, event_fields
from workers.wire.job import CANCELLED, CHAT_COMPLETIONS, FINISHED, QUEUED, STARTED, JobRecord

EVENT = TypeAdapter(ResponseStreamEvent)
RID = "resp_0123"


def _record(**responses) -> JobRecord:
    return JobRecord(
        id=RID,
        endpoint=CHAT_COMPLETIONS,
        model="tiny",
        request={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
        created_at=1700000000.5,
        responses={"input": [], "store": True, **responses},
    )


def _result(content: str | None, finish: str = "stop", tool_calls=None, cached: int = 0) -> dict:
    message = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "id": f"chatcmpl-{RID}",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "tiny",
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
        "usage": {
            "prompt_tokens": 9,
            "completion_tokens": 3,
            "total_tokens": 12,
            "prompt_tokens_details": {"cached_tokens": cached},
        },
    }


def _text_job(texts: list[str], finish: str = "stop") -> list:
    tokens = [StreamToken(0, i, t, 100 + i) for i, t in enumerate(texts)]
    return [*tokens, StreamDone(_result("".join(texts), finish))]


CALL = {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": ""}}


def _tool_job() -> list:
    """A worker's tool-call deltas (workers/wire/events.py): text held back, then the call."""
    deltas = [
        {"content": "Sure. "},
        {},  # a token held back while it may start a call
        {"tool_calls": [{"index": 0, **CALL}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
    ]
    tokens = [StreamToken(0, i, "x", 100 + i, delta=d) for i, d in enumerate(deltas)]
    call = {**CALL, "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    return [*tokens, StreamDone(_result("Sure. ", "tool_calls", [call]))]


def _message_events(deltas: int) -> list[str]:
    """The event types of one streamed `message` item with `deltas` text deltas."""
    return [
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]


def _checked(events: list[dict]) -> list[dict]:
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for e in events:
        EVENT.validate_python(e)  # the client's own types parse each one
    return events


def test_a_text_answer_streams_as_openai_sends_it() -> None:
    events = _checked(response_events(_record(), _text_job(["Hel", "", "lo"])))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        *_message_events(2),
        "response.completed",
    ]
    assert [e["delta"] for e in events if e["type"].endswith("text.delta")] == ["Hel", "lo"]
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["output"] == [events[-2]["item"]]
    assert events[-2]["item"]["id"] == events[2]["item"]["id"] == f"msg_{RID[5:]}_0"
    assert Response.model_validate(final).output_text == "Hello"
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 0


def test_a_cut_answer_ends_incomplete_and_a_background_one_starts_queued() -> None:
    events = _checked(response_events(_record(background=True), _text_job(["a"], "length")))
    assert events[0]["response"]["status"] == "queued"
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-2]["item"]["status"] == "incomplete"


def test_tool_calls_stream_as_function_call_items() -> None:
    events = _checked(response_events(_record(), _tool_job()))
    kinds = [e["type"] for e in events]
    assert kinds[2:] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added = events[8]["item"]
    assert (added["type"], added["call_id"], added["name"]) == (
        "function_call",
        "call_7",
        "get_weather",
    )
    assert events[11]["arguments"] == '{"city": "Paris"}'
    final = events[-1]["response"]
    assert final["output"] == [events[7]["item"], events[12]["item"]]  # same items, same ids
    Response.model_validate(final)


def test_failed_and_cancelled_jobs_end_with_response_failed() -> None:
    crash = StreamError.from_data(error_body("The engine failed.", "server_error", status=500))
    events = _checked(response_events(_record(), [StreamToken(0, 0, "a", 1), crash]))
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"] == {
        "code": "server_error",
        "message": "The engine failed.",
    }
    assert events[-2]["item"]["status"] == "incomplete"
    cancelled = StreamError.from_data(cancelled_error())
    events = _checked(response_events(_record(), [cancelled]))
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["status"] == "cancelled"
    assert events[-1]["response"]["error"] is None


@pytest.mark.parametrize("job", [_text_job(["a", "b", "c", "d"]), _tool_job()])
def test_a_replay_from_n_is_the_tail_of_the_whole_list(job: list) -> None:
    """The derivation is a function of the events alone: a new reader (another API process,
    after a restart) that derives from the stream's start and skips to N gets the tail,
    however the events were batched, with no gap and no duplicate."""
    whole = response_events(_record(), job)
    wire_events = [decode(event_fields(encode(e))) for e in job]  # as read back from Redis
    assert response_events(_record(), wire_events) == whole
    for n in range(-1, len(whole)):
        derive = ResponseEvents(_record())
        replay = [e for e in derive.start() if e["sequence_number"] > n]
        for event in wire_events:
            replay += [e for e in derive.feed(event) if e["sequence_number"] > n]
        assert replay == whole[n + 1 :]
    assert len({json.dumps(e, sort_keys=True) for e in whole}) == len(whole)
    assert ResponseEvents(_record()).feed(StreamToken(1, 0, "other choice", 5)) == []


def test_the_response_object_follows_the_job() -> None:
    record = _record(instructions="Be brief.", metadata={"k": "v"}, max_output_tokens=5)
    queued = wire.render(record)
    assert (queued["status"], queued["output"], queued["usage"]) == ("queued", [], None)
    assert queued["instructions"] == "Be brief." and queued["metadata"] == {"k": "v"}
    record.status = STARTED
    assert wire.render(record)["status"] == "in_progress"
    record.status, record.result, record.finished_at = (
        FINISHED,
        _result("hi", cached=4),
        1700000009.0,
    )
    done = wire.render(record)
    assert done["status"] == "completed" and done["completed_at"] == 1700000009
    assert done["usage"] == {
        "input_tokens": 9,
        "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 12,
    }
    assert Response.model_validate(done).output_text == "hi"
    record.status, record.error = CANCELLED, cancelled_error()
    assert wire.render(record)["status"] == "cancelled"
    assert wire.conversation(record)[-1]["content"][0]["text"] == "hi"
    assert wire.status_of(JobRecord("resp_1", CHAT_COMPLETIONS, "m", {}, status=QUEUED)) == "queued"


def _thinking_job() -> list:
    """A thinking model's deltas (workers/jobs.py): the thinking as `reasoning_content`,
    the token that closes it carrying the first content, then the answer."""
    deltas = [
        {"reasoning_content": "Let me "},
        {},  # a token held back while it may be `</think>`
        {"reasoning_content": "see.\n", "content": "Hi"},
        {"content": " there"},
    ]
    tokens = [StreamToken(0, i, "x", 100 + i, delta=d) for i, d in enumerate(deltas)]
    result = _result("Hi there")
    result["choices"][0]["message"]["reasoning_content"] = "Let me see.\n"
    return [*tokens, StreamDone(result)]


def test_a_thinking_models_thinking_is_a_reasoning_item_before_the_message() -> None:
    events = _checked(response_events(_record(), _thinking_job()))
    assert [e["type"] for e in events[2:]] == [
        "response.output_item.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.output_item.done",
        *_message_events(2),
        "response.completed",
    ]
    rs, msg = f"rs_{RID[5:]}_0", f"msg_{RID[5:]}_1"
    assert events[2]["item"] == {"id": rs, "type": "reasoning", "summary": [], "content": []}
    assert [e["delta"] for e in events[3:5]] == ["Let me ", "see.\n"]
    assert all((e["item_id"], e["output_index"]) == (rs, 0) for e in events[3:6])
    assert events[5]["text"] == "Let me see.\n"
    reasoning = {
        "id": rs,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "Let me see.\n"}],
    }
    assert events[6]["item"] == reasoning
    assert (events[7]["output_index"], events[7]["item"]["id"]) == (1, msg)
    final = events[-1]["response"]
    # the stream's items, indexes and ids are the final output's
    assert final["output"] == [reasoning, events[13]["item"]]
    parsed = Response.model_validate(final)
    assert parsed.output_text == "Hi there"  # the thinking is never in the answer
    assert parsed.output[0].content[0].text == "Let me see.\n"
    record = _record()
    record.status, record.result = FINISHED, _thinking_job()[-1].result
    assert wire.render(record)["output"] == final["output"]
    # a continuation lists the reasoning among its input items, and leaves it out of the prompt
    conversation = wire.conversation(record)
    assert conversation == final["output"]
    wire.ResponseItemList(
        object="list", data=conversation, first_id=rs, last_id=msg, has_more=False
    )
    assert messages(conversation) == [{"role": "assistant", "content": "Hi there"}]
