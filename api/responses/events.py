"""A response's streaming events, derived from its job's event stream.

The events (`response.created` ... one terminal `response.completed` / `.incomplete` /
`.failed`) are a pure, deterministic function of the record's immutable fields and the
job's stream events (`StreamToken`... `StreamDone` | `StreamError`): `sequence_number` is
an event's position in the derived list. Any API process, during or after the run, replays
from `starting_after + 1` by deriving again from the job stream's start and skipping, with
no gap and no duplicate, and nothing is kept in memory between requests. A worker that
resumes a job continues its stream without re-sending a token (workers/wire/events.py), so
the derivation continues too.

The chat chunks of api/chunks.py (`ChunkStream`, which turns a token into its content and
tool-call deltas) are mapped to the Responses events: a thinking model's thinking
(`reasoning_content`) opens a `reasoning` item whose `reasoning_text` deltas follow; text
opens a `message` item and its `output_text` part, a tool call's first delta opens a
`function_call` item (id, call id and name) whose argument fragments follow. A cancelled
job ends with `response.failed` whose response's status is `cancelled` (OpenAI's streams
have no cancelled event type).
"""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

from api.chunks import ChunkStream
from workers.wire import responses_api as wire
from workers.wire.events import StreamDone, StreamError, StreamEvent, StreamToken
from workers.wire.job import CANCELLED, FAILED, FINISHED, JobRecord

_ONE_CHOICE = SimpleNamespace(include_usage=False, logprobs=False, choices=1, n=1)


class ResponseEvents:
    """Derives one response's events, in order, as its job's events arrive."""

    def __init__(self, record: JobRecord) -> None:
        self.record = record
        self.chunks = ChunkStream(record, _ONE_CHOICE)
        self.sequence = 0
        self.items = 0  # output items opened so far
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.ended = False

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _response(self, status: str, **ending: Any) -> dict[str, Any]:
        return wire.render(self.record, status=status, **ending)

    def start(self) -> list[dict[str, Any]]:
        """`response.created` and `response.in_progress`, before any token."""
        first = "queued" if wire.stored_request(self.record).background else "in_progress"
        return [
            self._event("response.created", response=self._response(first)),
            self._event("response.in_progress", response=self._response("in_progress")),
        ]

    def feed(self, event: StreamEvent) -> list[dict[str, Any]]:
        """The events one job event makes (none for a token with nothing to show)."""
        if self.ended:
            return []
        if isinstance(event, StreamToken):
            if event.choice != 0:
                return []
            chunk = self.chunks.token(event)
            delta = chunk["choices"][0]["delta"] if chunk is not None else {}
            out = self._reasoning(delta.get("reasoning_content") or "")
            out += self._text(delta.get("content") or "")
            for call in delta.get("tool_calls") or []:
                out += self._call(call)
            return out
        if isinstance(event, StreamDone):
            return self._finish(event.result)
        if isinstance(event, StreamError):
            return self._fail(event.to_data())
        return []

    # ------------------------------------------------------------ items

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        """A thinking model's thinking: a `reasoning` item before the message, its text as
        `response.reasoning_text.delta` events (as OpenAI streams gpt-oss's reasoning)."""
        if not text:
            return []
        out: list[dict[str, Any]] = []
        if self.open is None or self.open["type"] != "reasoning":
            out += self._close("completed")
            index = self.items
            self.items += 1
            item = wire.item_id("rs", self.record.id, index)
            self.open = {"type": "reasoning", "id": item, "index": index, "text": ""}
            added = wire.reasoning_item(item, None)
            out.append(self._event("response.output_item.added", output_index=index, item=added))
        self.open["text"] += text
        out.append(
            self._event(
                "response.reasoning_text.delta", **self._where(), content_index=0, delta=text
            )
        )
        return out

    def _text(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        out: list[dict[str, Any]] = []
        if self.open is None or self.open["type"] != "message":
            out += self._close("completed")
            out += self._open_message()
        self.open["text"] += text
        out.append(
            self._event(
                "response.output_text.delta",
                **self._where(),
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return out

    def _open_message(self) -> list[dict[str, Any]]:
        index = self.items
        self.items += 1
        item = wire.item_id("msg", self.record.id, index)
        self.open = {"type": "message", "id": item, "index": index, "text": ""}
        return [
            self._event(
                "response.output_item.added",
                output_index=index,
                item=wire.message_item(item, None, "in_progress"),
            ),
            self._event(
                "response.content_part.added",
                item_id=item,
                output_index=index,
                content_index=0,
                part=wire.text_part(""),
            ),
        ]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        function = call.get("function") or {}
        if call.get("id"):  # a call's first delta: id, type and name
            out += self._close("completed")
            index = self.items
            self.items += 1
            item = wire.item_id("fc", self.record.id, index)
            self.open = {
                "type": "function_call",
                "id": item,
                "index": index,
                "call_id": call["id"],
                "name": function.get("name", ""),
                "arguments": "",
            }
            added = wire.function_call_item(item, call["id"], self.open["name"], "", "in_progress")
            out.append(self._event("response.output_item.added", output_index=index, item=added))
        fragment = function.get("arguments") or ""
        if fragment and self.open is not None and self.open["type"] == "function_call":
            self.open["arguments"] += fragment
            out.append(
                self._event(
                    "response.function_call_arguments.delta", **self._where(), delta=fragment
                )
            )
        return out

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": self.open["index"]}

    def _close(self, status: str) -> list[dict[str, Any]]:
        """The `.done` events of the item being streamed, if any."""
        item, self.open = self.open, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": item["index"]}
        if item["type"] == "reasoning":
            text = item["text"]
            return [
                self._event("response.reasoning_text.done", **where, content_index=0, text=text),
                self._event(
                    "response.output_item.done",
                    output_index=item["index"],
                    item=wire.reasoning_item(item["id"], text),
                ),
            ]
        if item["type"] == "message":
            text = item["text"]
            return [
                self._event(
                    "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
                ),
                self._event(
                    "response.content_part.done",
                    **where,
                    content_index=0,
                    part=wire.text_part(text),
                ),
                self._event(
                    "response.output_item.done",
                    output_index=item["index"],
                    item=wire.message_item(item["id"], text, status),
                ),
            ]
        done = wire.function_call_item(
            item["id"], item["call_id"], item["name"], item["arguments"], status
        )
        return [
            self._event(
                "response.function_call_arguments.done",
                **where,
                name=item["name"],
                arguments=item["arguments"],
            ),
            self._event("response.output_item.done", output_index=item["index"], item=done),
        ]

    # ------------------------------------------------------------ the end

    def _finish(self, result: dict[str, Any]) -> list[dict[str, Any]]:
        self.ended = True
        status = wire.response_status(FINISHED, result)
        out = self._close(status)
        response = self._response(status, result=result)
        return [*out, self._event(f"response.{status}", response=response)]

    def _fail(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        self.ended = True
        out = self._close("incomplete")
        status = wire.response_status(error_job_status(error), None)
        response = self._response(status, error=error)
        return [*out, self._event("response.failed", response=response)]


def error_job_status(error: dict[str, Any]) -> str:
    """The job status an `error` event ends a job with: a cancel, or a failure."""
    return CANCELLED if (error.get("error") or {}).get("code") == "cancelled" else FAILED


def response_events(record: JobRecord, events: Iterable[StreamEvent]) -> list[dict[str, Any]]:
    """Every event of the response, from its job's events from the stream's start."""
    derive = ResponseEvents(record)
    out = derive.start()
    for event in events:
        out += derive.feed(event)
    return out
