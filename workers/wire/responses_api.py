"""OpenAI's Responses API objects, rendered from a job record and its chat result.

A response is a chat-completion job whose record also carries the Responses request
(`JobRecord.responses`, written by api/responses/requests.py): the request's fields as the
client gave them (normalised), its input items with their ids, and `context`, the
conversation of its `previous_response_id` (that response's context, input and output
items). The job id is the response id (`resp_<hex>`). Everything here is a pure function of
the record (and of the chat result a worker wrote), so any API process renders the same
object, and the batch worker can render a `/v1/responses` line's body with the same code.

Item ids are a function of the response id and the item's place in the output, so an
output item streamed while the job runs has the id the finished response shows.
"""

from __future__ import annotations

from typing import Any, Literal

from workers.wire.bodies import Body
from workers.wire.job import CANCELLED, FAILED, FINISHED, QUEUED, STARTED, JobRecord

RESPONSE_ID_PREFIX = "resp_"
RESPONSE_STATUSES = ("queued", "in_progress", "completed", "incomplete", "failed", "cancelled")
ItemStatus = Literal["in_progress", "completed", "incomplete"]

# ---------------------------------------------------------------- the models


class InputText(Body):
    type: Literal["input_text"]
    text: str


class OutputText(Body):
    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]]
    logprobs: list[dict[str, Any]] = []


class InputMessage(Body):
    id: str
    type: Literal["message"]
    role: Literal["user", "system", "developer"]
    status: ItemStatus
    content: list[InputText]


class OutputMessage(Body):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: ItemStatus
    content: list[OutputText]


class FunctionCall(Body):
    id: str
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class FunctionCallOutput(Body):
    id: str
    type: Literal["function_call_output"]
    call_id: str
    output: str
    status: ItemStatus


OutputItem = OutputMessage | FunctionCall
Item = InputMessage | OutputMessage | FunctionCall | FunctionCallOutput


class FunctionTool(Body):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextConfig(Body):
    format: dict[str, Any]


class ResponseError(Body):
    code: str
    message: str


class IncompleteDetails(Body):
    reason: Literal["max_output_tokens"]


class InputTokensDetails(Body):
    cached_tokens: int
    cache_write_tokens: int = 0


class OutputTokensDetails(Body):
    reasoning_tokens: int


class ResponseUsage(Body):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseObject(Body):
    """A response (`POST /v1/responses`, `GET /v1/responses/{id}`), OpenAI's `Response`."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal[RESPONSE_STATUSES]  # type: ignore[valid-type]
    background: bool
    completed_at: int | None
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    service_tier: str
    store: bool
    temperature: float | None
    text: TextConfig
    tool_choice: str | dict[str, Any]
    tools: list[FunctionTool]
    top_p: float | None
    truncation: Literal["disabled"]
    usage: ResponseUsage | None
    user: str | None
    metadata: dict[str, str]


class ResponseDeleted(Body):
    id: str
    object: Literal["response.deleted"]
    deleted: bool


class ResponseItemList(Body):
    """`GET /v1/responses/{id}/input_items`: OpenAI's cursor-paged list."""

    object: Literal["list"]
    data: list[Item]
    first_id: str | None
    last_id: str | None
    has_more: bool


# ---------------------------------------------------------------- ids


def is_response_id(job_id: str) -> bool:
    return job_id.startswith(RESPONSE_ID_PREFIX)


def item_id(kind: str, response_id: str, output_index: int) -> str:
    """The id of output item `output_index` (`kind`: msg or fc), the same in the stream and
    in the finished response."""
    return f"{kind}_{response_id.removeprefix(RESPONSE_ID_PREFIX)}_{output_index}"


# ---------------------------------------------------------------- rendering


def status_of(record: JobRecord) -> str:
    """The response's status from its job's: finished is completed, or incomplete when the
    token limit cut it."""
    if record.status == FINISHED:
        return "incomplete" if _cut(record.result or {}) else "completed"
    return {QUEUED: "queued", STARTED: "in_progress", FAILED: "failed", CANCELLED: "cancelled"}.get(
        record.status, "in_progress"
    )


def _cut(result: dict[str, Any]) -> bool:
    return any(c.get("finish_reason") == "length" for c in result.get("choices") or [])


def output_items(response_id: str, result: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat result's message as output items: its text as one `message` (when there is
    text), then one `function_call` per tool call."""
    choices = result.get("choices") or [{}]
    choice = choices[0]
    message = choice.get("message") or {}
    status = "incomplete" if choice.get("finish_reason") == "length" else "completed"
    items: list[dict[str, Any]] = []
    if message.get("content"):
        items.append(message_item(item_id("msg", response_id, 0), message["content"], status))
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        items.append(
            function_call_item(
                item_id("fc", response_id, len(items)),
                call.get("id", ""),
                function.get("name", ""),
                function.get("arguments", ""),
                "completed",
            )
        )
    return items


def message_item(item: str, text: str | None, status: str) -> dict[str, Any]:
    """An assistant `message` item: without content while it is only announced (None)."""
    content = [] if text is None else [text_part(text)]
    return {
        "id": item,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(
    item: str, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    return {
        "id": item,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """A chat result's usage in the Responses layout; cached tokens from the prefix cache."""
    if not chat_usage:
        return None
    prompt = int(chat_usage.get("prompt_tokens", 0))
    completion = int(chat_usage.get("completion_tokens", 0))
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": int(cached), "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def failure(error: dict[str, Any] | None) -> dict[str, Any]:
    """A failed job's error body (`{"error": {...}, "status"}`) as the response's `error`,
    whose `code` is one of OpenAI's: the prompt's fault, a limit, or the server's."""
    detail = (error or {}).get("error") or {}
    status = (error or {}).get("status", 500)
    code = "server_error"
    if status == 429:
        code = "rate_limit_exceeded"
    elif isinstance(status, int) and 400 <= status < 500:
        code = "invalid_prompt"
    return {"code": code, "message": detail.get("message") or "The response failed."}


def render(
    record: JobRecord,
    *,
    status: str | None = None,
    result: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
    completed_at: float | None = None,
) -> dict[str, Any]:
    """The Response object of `record`: as the record is now, or, with `status` (and the
    `result` or `error` that ended it), as a stream event shows it at that point."""
    asked = record.responses or {}
    if status is None:
        status = status_of(record)
        result, error = record.result, record.error
        completed_at = record.finished_at if status == "completed" else None
    output = output_items(record.id, result) if result is not None else []
    body = {
        "id": record.id,
        "object": "response",
        "created_at": int(record.created_at),
        "status": status,
        "background": bool(asked.get("background", False)),
        "completed_at": None if completed_at is None else int(completed_at),
        "error": failure(error) if status == "failed" else None,
        "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete" else None),
        "instructions": asked.get("instructions"),
        "max_output_tokens": asked.get("max_output_tokens"),
        "model": record.responds_as,
        "output": output,
        "parallel_tool_calls": asked.get("parallel_tool_calls", True),
        "previous_response_id": asked.get("previous_response_id"),
        "service_tier": asked.get("service_tier", "default"),
        "store": asked.get("store", True),
        "temperature": asked.get("temperature", 1.0),
        "text": asked.get("text") or {"format": {"type": "text"}},
        "tool_choice": asked.get("tool_choice", "auto"),
        "tools": asked.get("tools") or [],
        "top_p": asked.get("top_p", 1.0),
        "truncation": "disabled",
        "usage": usage(result.get("usage")) if result is not None else None,
        "user": asked.get("user"),
        "metadata": asked.get("metadata") or {},
    }
    return ResponseObject(**body).dump()


def input_items(record: JobRecord) -> list[dict[str, Any]]:
    """The response's own input items, with their ids, in the order given."""
    return list((record.responses or {}).get("input") or [])


def conversation(record: JobRecord) -> list[dict[str, Any]]:
    """What a response that names this one as `previous_response_id` continues: this one's
    context, its input items and its output items (its instructions are not carried)."""
    asked = record.responses or {}
    output = output_items(record.id, record.result) if record.result is not None else []
    return [*(asked.get("context") or []), *input_items(record), *output]
