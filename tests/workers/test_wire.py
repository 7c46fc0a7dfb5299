"""The wire module on its own (no Redis server): codecs round-trip, the OpenAI error body has
one shape, and a job's end is written the same way by whoever writes it."""

from __future__ import annotations

import json

import fakeredis
import pytest

from workers import keys
from workers.wire.commands import COMMAND_LOAD, AdminCommand, decode_command, encode_command
from workers.wire.errors import (
    OpenAIError,
    cancelled_error,
    engine_refusal,
    error_body,
    openai_error,
)
from workers.wire.events import (
    EVENT_DONE,
    EVENT_ERROR,
    EVENT_TOKEN,
    StreamDone,
    StreamError,
    StreamOther,
    StreamToken,
    decode,
    decode_event,
    encode,
    ending,
    event_fields,
    is_terminal,
    token_event,
    write_ending,
)
from workers.wire.histograms import histogram_fields
from workers.wire.job import CANCELLED, FINISHED, JobRecord
from workers.wire.text import as_str, text_hash
from workers.wire.worker_info import WorkerInfo


def test_as_str_takes_bytes_or_str():
    assert as_str(b"caf\xc3\xa9") == as_str("café") == "café"
    assert text_hash({b"a": b"1", "b": "2"}) == {"a": "1", "b": "2"}


def test_an_event_round_trips_through_its_stream_fields():
    event = token_event(1, 4, "héllo", 42, -0.5, None, 2, top_logprobs=[(7, -1.0)])
    kind, data = decode_event({k.encode(): v.encode() for k, v in event_fields(event).items()})
    assert kind == EVENT_TOKEN
    assert data == {
        "choice": 1,
        "index": 4,
        "text": "héllo",
        "token_id": 42,
        "logprob": -0.5,
        "top_logprobs": [[7, -1.0]],
        "finish_reason": None,
        "attempt": 2,
    }
    assert "\\u" not in event[1]  # text stays readable (ensure_ascii=False)


def test_the_openai_error_body_has_one_shape():
    assert openai_error("bad", param="n") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": None}
    }
    assert error_body("bad", param="n", status=422) == {
        **openai_error("bad", param="n"),
        "status": 422,
    }
    assert cancelled_error()["status"] == 409 and cancelled_error()["error"]["code"] == "cancelled"


def test_ending_gives_the_fields_and_the_terminal_event():
    fields, (kind, data) = ending(FINISHED, {"id": "x"})
    assert kind == EVENT_DONE and json.loads(data) == {"id": "x"}
    assert fields["status"] == FINISHED and json.loads(fields["result"]) == {"id": "x"}
    assert fields["response_status"] == "completed"  # the response's, for the outbox entry
    cut = ending(FINISHED, {"choices": [{"finish_reason": "length"}]})[0]
    assert cut["response_status"] == "incomplete"
    fields, (kind, data) = ending(CANCELLED, cancelled_error())
    assert kind == EVENT_ERROR and json.loads(fields["error"]) == cancelled_error()
    assert fields["response_status"] == "cancelled"


def test_write_ending_writes_record_event_and_count_in_one_pipeline():
    conn = fakeredis.FakeRedis()
    record = JobRecord("j1", "/v1/completions", "m", {"prompt": "x"})
    conn.hset(keys.job("j1"), mapping=record.to_hash())
    with conn.pipeline() as pipe:
        write_ending(pipe, "j1", CANCELLED, cancelled_error())
        pipe.execute()
    stored = JobRecord.from_hash(conn.hgetall(keys.job("j1")))
    assert stored.status == CANCELLED and stored.error == cancelled_error()
    [(_, fields)] = conn.xrange(keys.job_events("j1"))
    assert decode_event(fields) == (EVENT_ERROR, cancelled_error())
    assert conn.ttl(keys.job_events("j1")) > 0
    assert conn.hget(keys.METRIC_JOBS, CANCELLED) == b"1"


def test_records_round_trip_through_a_redis_hash():
    record = JobRecord("j1", "/v1/chat/completions", "m", {"messages": []}, attempts=2)
    assert JobRecord.from_hash(record.to_hash()) == record
    info = WorkerInfo("w", pid=3, models=["m"], pool={"m": {"state": "ready"}}, device="cuda:1")
    assert WorkerInfo.from_hash(info.to_hash()) == info


def test_a_worker_record_from_before_devices_reads_as_a_cpu_worker():
    old = {k: v for k, v in WorkerInfo("w", device="cuda:0").to_hash().items() if k != "device"}
    assert WorkerInfo.from_hash(old).device == "cpu"


def test_admin_commands_round_trip_and_refuse_anything_else():
    assert decode_command(encode_command(COMMAND_LOAD, "m")) == (COMMAND_LOAD, "m")
    with pytest.raises(ValueError):
        encode_command("reboot", "m")
    with pytest.raises(ValueError):
        decode_command(b'{"op": "reboot", "model": "m"}')


def test_histogram_fields_pick_the_first_bucket_that_holds_the_value():
    assert histogram_fields("m", 0.3, (0.1, 0.5, 1.0)) == ("m|0.5", "m|count", "m|sum")
    assert histogram_fields("m", 5, (0.1, 0.5, 1.0))[0] == "m|+Inf"


def test_a_token_event_keeps_its_bytes_on_the_wire():
    """Workers of this version resume streams older ones wrote, and the other way round:
    the typed event writes exactly the JSON the stream always held."""
    event = StreamToken(
        choice=0,
        index=3,
        text="é",
        token_id=9,
        logprob=-0.25,
        finish_reason="stop",
        attempt=1,
        top_logprobs=((9, -0.25),),
        logprobs={"token": "é", "logprob": -0.25},
        delta={"content": "é"},
    )
    assert encode(event) == (
        EVENT_TOKEN,
        '{"choice": 0, "index": 3, "text": "é", "token_id": 9, "logprob": -0.25, '
        '"top_logprobs": [[9, -0.25]], "finish_reason": "stop", "attempt": 1, '
        '"logprobs": {"token": "é", "logprob": -0.25}, "delta": {"content": "é"}}',
    )
    assert decode(event_fields(encode(event))) == event
    # as Redis sends an entry (api/streams/stream_hub.py's XREAD skips redis-py's callback)
    flat = [part.encode() for pair in event_fields(encode(event)).items() for part in pair]
    assert decode(flat) == event


def test_terminal_events_decode_to_their_types_and_unknown_kinds_are_kept_apart():
    _, done = ending(FINISHED, {"id": "x"})
    assert decode(event_fields(done)) == StreamDone({"id": "x"})
    _, error = ending(CANCELLED, cancelled_error())
    decoded = decode(event_fields(error))
    assert isinstance(decoded, StreamError) and decoded.status == 409
    assert is_terminal(decoded) and not is_terminal(StreamToken(0, 0, "", 1))
    odd = decode({"event": "note", "data": '{"x": 1}'})
    assert odd == StreamOther("note", {"x": 1}) and not is_terminal(odd)
    assert StreamError.from_data({"error": {"message": "m"}, "status": 200}).status == 500


def test_the_api_and_the_workers_build_error_bodies_in_one_place():
    from api.errors import ModelNotFound
    from workers.errors import UnknownModelError

    api_error, job_error = ModelNotFound("m"), UnknownModelError("no such model", param="model")
    assert isinstance(api_error, OpenAIError) and isinstance(job_error, OpenAIError)
    assert api_error.body() == openai_error(
        "The model 'm' does not exist.", param="model", code="model_not_found"
    )
    assert job_error.body() == error_body(
        "no such model", param="model", code="model_not_found", status=404
    )
    assert job_error.body() == {**job_error.openai_body(), "status": 404}


def test_an_engine_refusal_reads_the_same_at_submission_and_in_a_worker():
    from api.errors import InvalidRequest
    from runtime.errors import ContextLengthError, EmptyPromptError
    from workers.errors import InvalidJobRequest

    empty = EmptyPromptError("the prompt is empty")
    api_error = engine_refusal(empty, InvalidRequest, default_param="messages", as_sentence=True)
    job_error = engine_refusal(empty, InvalidJobRequest)
    assert (api_error.status, api_error.message, api_error.param) == (
        400,
        "The prompt is empty.",
        "prompt",
    )
    assert (job_error.status, job_error.message, job_error.param) == (
        400,
        "the prompt is empty",
        "prompt",
    )
    unnamed = engine_refusal(ContextLengthError("too long."), InvalidRequest, default_param="x")
    assert (unnamed.message, unnamed.param) == ("too long.", "x")


def test_an_admin_command_is_typed_and_keeps_its_json():
    command = AdminCommand(COMMAND_LOAD, "m")
    assert command.encode() == encode_command(COMMAND_LOAD, "m") == '{"op": "load", "model": "m"}'
    assert AdminCommand.decode(command.encode().encode()) == command
    with pytest.raises(ValueError, match="not an admin command"):
        AdminCommand.decode('{"op": "load", "model": 3}')
