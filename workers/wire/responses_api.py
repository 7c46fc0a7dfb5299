"""OpenAI's Responses API objects, rendered from a job record and its chat result.

A response is a chat-completion job whose record also carries the Responses request
(`JobRecord.responses`, a `StoredRequest`: written by api/responses/requests.py with
`encode`, read everywhere with `stored_request`): the request's fields as the client gave
them (normalised), its input items with their ids, and `context`, the conversation of its
`previous_response_id` (that response's context, input and output items). The job id is
the response id (`resp_<hex>`). Everything here is a pure function of the record (and of
the chat result a worker wrote), so any API process renders the same object, and the batch
worker can render a `/v1/responses` line's body with the same code.

Item ids are a function of the response id and the item's place in the output, so an
output item streamed while the job runs has the id the finished response shows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

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


class ReasoningText(Body):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(Body):
    """A thinking model's thinking (`reasoning_content` of the chat result), shown as OpenAI
    shows gpt-oss's: its text as `reasoning_text` content, no summary."""

    id: str
    type: Literal["reasoning"]
    summary: list[dict[str, Any]]
    content: list[ReasoningText]


OutputItem = ReasoningItem | OutputMessage | FunctionCall
Item = InputMessage | ReasoningItem | OutputMessage | FunctionCall | FunctionCallOutput


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


# ---------------------------------------------------------------- the stored request


class StoredRequest(BaseModel):
    """`JobRecord.responses`: what a Response object shows of its request, every default in
    this one place. `encode` writes it; `stored_request` reads it (a record written before a
    field existed reads that field's default)."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = None  # a batch line's response id (its job has the line's own id)
    input: list[dict[str, Any]] = Field(default_factory=list)  # items with their ids
    context: list[dict[str, Any]] = Field(default_factory=list)  # the previous conversation
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    tools: list[dict[str, Any]] = Field(default_factory=list)  # Responses' flat function tools
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    metadata: dict[str, str] = Field(default_factory=dict)
    previous_response_id: str | None = None
    background: bool = False
    store: bool = True
    stream: bool = False
    service_tier: str = "default"
    user: str | None = None

    def encode(self) -> dict[str, Any]:
        """The JSON object `JobRecord.responses` holds."""
        return self.model_dump(mode="json")


def stored_request(record: JobRecord) -> StoredRequest:
    """The Responses request a record keeps (every default, for a record without one)."""
    return StoredRequest.model_validate(record.responses or {})


# ---------------------------------------------------------------- ids


def is_response_id(job_id: str) -> bool:
    return job_id.startswith(RESPONSE_ID_PREFIX)


def item_id(kind: str, response_id: str, output_index: int) -> str:
    """The id of output item `output_index` (`kind`: rs, msg or fc), the same in the stream
    and in the finished response."""
    return f"{kind}_{response_id.removeprefix(RESPONSE_ID_PREFIX)}_{output_index}"


# ---------------------------------------------------------------- rendering


def status_of(record: JobRecord) -> str:
    """The response's status from its job's (see `response_status`)."""
    return response_status(record.status, record.result)


def response_status(job_status: str, result: Mapping[str, Any] | None) -> str:
    """A response's status, the one derivation of it: a finished job is `completed`, or
    `incomplete` when the token limit cut it (`is_cut`); the others map by name."""
    if job_status == FINISHED:
        return "incomplete" if is_cut(result or {}) else "completed"
    return {QUEUED: "queued", STARTED: "in_progress", FAILED: "failed", CANCELLED: "cancelled"}.get(
        job_status, "in_progress"
    )


def is_cut(result: Mapping[str, Any]) -> bool:
    """A finished job's result says the token limit cut it: a chat body whose choice stopped
    at `length`, or a Response body (a batch line's) that is `incomplete`."""
    if result.get("status") == "incomplete" or result.get("incomplete_details"):
        return True
    choices = result.get("choices")
    if not isinstance(choices, list):
        return False
    return any(isinstance(c, dict) and c.get("finish_reason") == "length" for c in choices)


def output_items(response_id: str, result: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat result's message as output items, in the order the stream opens them: its
    thinking as one `reasoning` item (when there is any), its text as one `message` (when
    there is text), then one `function_call` per tool call."""
    choices = result.get("choices") or [{}]
    choice = choices[0]
    message = choice.get("message") or {}
    status = "incomplete" if choice.get("finish_reason") == "length" else "completed"
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        thinking = message["reasoning_content"]
        items.append(reasoning_item(item_id("rs", response_id, len(items)), thinking))
    if message.get("content"):
        msg = item_id("msg", response_id, len(items))
        items.append(message_item(msg, message["content"], status))
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


def reasoning_item(item: str, text: str | None) -> dict[str, Any]:
    """A `reasoning` item: without content while it is only announced (None)."""
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"id": item, "type": "reasoning", "summary": [], "content": content}


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
    """A chat result's usage in the Responses layout; cached tokens from the prefix cache,
    reasoning tokens from a thinking model's answer."""
    if not chat_usage:
        return None
    prompt = int(chat_usage.get("prompt_tokens", 0))
    completion = int(chat_usage.get("completion_tokens", 0))
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    reasoning = (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": int(cached), "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": int(reasoning)},
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
    asked = stored_request(record)
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
        "background": asked.background,
        "completed_at": None if completed_at is None else int(completed_at),
        "error": failure(error) if status == "failed" else None,
        "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete" else None),
        "instructions": asked.instructions,
        "max_output_tokens": asked.max_output_tokens,
        "model": record.responds_as,
        "output": output,
        "parallel_tool_calls": asked.parallel_tool_calls,
        "previous_response_id": asked.previous_response_id,
        "service_tier": asked.service_tier,
        "store": asked.store,
        "temperature": asked.temperature,
        "text": asked.text,
        "tool_choice": asked.tool_choice,
        "tools": asked.tools,
        "top_p": asked.top_p,
        "truncation": "disabled",
        "usage": usage(result.get("usage")) if result is not None else None,
        "user": asked.user,
        "metadata": asked.metadata,
    }
    return ResponseObject(**body).dump()


def input_items(record: JobRecord) -> list[dict[str, Any]]:
    """The response's own input items, with their ids, in the order given."""
    return list(stored_request(record).input)


def conversation(record: JobRecord) -> list[dict[str, Any]]:
    """What a response that names this one as `previous_response_id` continues: this one's
    context, its input items and its output items (its instructions are not carried)."""
    asked = stored_request(record)
    output = output_items(record.id, record.result) if record.result is not None else []
    return [*asked.context, *asked.input, *output]
