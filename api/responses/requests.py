"""A Responses API request (`POST /v1/responses`), checked and translated to the chat
request a worker runs (workers/wire/responses_api.py renders the answer).

The translation: `instructions` -> a system message first (never carried over from a
previous response, as OpenAI does); the previous response's conversation (its context,
input and output items) -> the messages after it, so that a turn's prompt starts with the
tokens the last turn ran and its prefix comes from the prefix cache; then `input` (a string,
or message / `function_call` / `function_call_output` items) -> messages;
`max_output_tokens` -> `max_tokens`; `tools` (Responses' flat function tools) and
`tool_choice` -> chat's; `text.format` -> `response_format`; `service_tier` -> llmq's
integer `priority` (lower runs sooner). Every field OpenAI defines and llmq does not do is
refused with a 400 naming it, never ignored.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator

from api.errors import InvalidRequest, UnsupportedFeature
from api.schemas import (
    MAX_MODEL_ID_CHARS,
    MAX_USER_CHARS,
    StrictModel,
    _in_range,
    _max_tokens,
    _short,
    validation_error,
)
from workers.wire.responses_api import RESPONSE_ID_PREFIX

# service_tier -> (llmq priority, the tier the response reports); flex waits behind the rest
SERVICE_TIERS: dict[str, tuple[int, str]] = {
    "priority": (-1, "priority"),
    "default": (0, "default"),
    "auto": (0, "default"),
    "flex": (1, "flex"),
}
# OpenAI's request fields that llmq does not do: a 400 naming each (null or empty is fine)
UNSUPPORTED = (
    "reasoning",
    "include",
    "prompt",
    "conversation",
    "max_tool_calls",
    "top_logprobs",
    "stream_options",
    "prompt_cache_key",
    "prompt_cache_retention",
    "context_management",
)
MAX_INPUT_ITEMS = 4096


def new_response_id() -> str:
    return RESPONSE_ID_PREFIX + uuid.uuid4().hex


class FunctionToolParam(StrictModel):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, max_length=64)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextParam(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only verbosity a non-reasoning model has


class ResponseRequest(StrictModel):
    model: str = Field(min_length=1, max_length=MAX_MODEL_ID_CHARS)
    input: Any = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    background: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = Field(default=None, max_length=64)
    tools: list[Any] | None = Field(default=None, max_length=128)
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    text: TextParam | None = None
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = Field(default=None, max_length=MAX_USER_CHARS)
    safety_identifier: str | None = Field(default=None, max_length=MAX_USER_CHARS)

    @field_validator("max_output_tokens")
    @classmethod
    def _max(cls, v: int | None) -> int | None:
        return _max_tokens("max_output_tokens", v)

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float | None) -> float | None:
        return v if v is None else _in_range("temperature", v, 0, 2)

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float | None) -> float | None:
        return v if v is None else _in_range("top_p", v, 0, 1, open_low=True)

    @property
    def tier(self) -> str:
        return SERVICE_TIERS[self.service_tier or "auto"][1]

    @property
    def priority(self) -> int:
        return SERVICE_TIERS[self.service_tier or "auto"][0]


def parse_response_request(body: dict[str, Any]) -> ResponseRequest:
    """Validate a `POST /v1/responses` body; raises `InvalidRequest` / `UnsupportedFeature`."""
    for name in UNSUPPORTED:
        if body.get(name) not in (None, [], {}):
            raise UnsupportedFeature(f"{name} is not supported by this server.", param=name)
    try:
        req = ResponseRequest.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
    if req.input is None:
        raise InvalidRequest("input is required.", param="input")
    if req.truncation == "auto":
        raise UnsupportedFeature(
            "truncation 'auto' is not supported; the input must fit the context.",
            param="truncation",
        )
    if req.background and not req.store:
        raise InvalidRequest("background requires store to be true.", param="background")
    if req.previous_response_id is not None and not req.previous_response_id.startswith(
        RESPONSE_ID_PREFIX
    ):
        raise InvalidRequest(
            f"previous_response_id must be a response id (resp_...), got "
            f"{_short(req.previous_response_id)}.",
            param="previous_response_id",
        )
    return req


# ---------------------------------------------------------------- input items


def input_items(value: Any, response_id: str) -> list[dict[str, Any]]:
    """`input` as stored items with ids: a string is one user message."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidRequest("input must be a string or a non-empty list of items.", param="input")
    if len(value) > MAX_INPUT_ITEMS:
        raise InvalidRequest(f"input must have at most {MAX_INPUT_ITEMS} items.", param="input")
    suffix = response_id.removeprefix(RESPONSE_ID_PREFIX)
    return [_item(item, f"input[{i}]", f"{suffix}_in{i}") for i, item in enumerate(value)]


def _item(item: Any, param: str, suffix: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise InvalidRequest(f"{param} must be an object, got {_short(item)}.", param=param)
    kind = item.get("type", "message")
    given = item.get("id")
    if given is not None and (not isinstance(given, str) or not 1 <= len(given) <= 128):
        raise InvalidRequest(f"{param}.id must be a string.", param=f"{param}.id")
    if kind == "message":
        return _message(item, param, given or f"msg_{suffix}")
    if kind == "function_call":
        fields = _strings(item, param, ("call_id", "name", "arguments"), {"type", "id", "status"})
        return {"id": given or f"fc_{suffix}", "type": kind, **fields, "status": "completed"}
    if kind == "function_call_output":
        fields = _strings(item, param, ("call_id", "output"), {"type", "id", "status"})
        return {"id": given or f"fco_{suffix}", "type": kind, **fields, "status": "completed"}
    raise UnsupportedFeature(
        f"{param}.type must be message, function_call or function_call_output, got {_short(kind)}.",
        param=f"{param}.type",
    )


def _strings(item: dict[str, Any], param: str, names: tuple[str, ...], extra: set[str]):
    unknown = sorted(set(item) - set(names) - extra)
    if unknown:
        name = f"{param}.{unknown[0]}"
        raise InvalidRequest(f"Unrecognized request argument supplied: {name}", param=name)
    fields = {}
    for name in names:
        value = item.get(name)
        if not isinstance(value, str):
            raise InvalidRequest(
                f"{param}.{name} must be a string, got {_short(value)}.", param=f"{param}.{name}"
            )
        fields[name] = value
    return fields


def _message(item: dict[str, Any], param: str, ident: str) -> dict[str, Any]:
    unknown = sorted(set(item) - {"type", "id", "role", "content", "status"})
    if unknown:
        name = f"{param}.{unknown[0]}"
        raise InvalidRequest(f"Unrecognized request argument supplied: {name}", param=name)
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise InvalidRequest(
            f"{param}.role must be user, system, developer or assistant, got {_short(role)}.",
            param=f"{param}.role",
        )
    part_type = "output_text" if role == "assistant" else "input_text"
    content = item.get("content")
    if isinstance(content, str):
        texts = [content]
    elif isinstance(content, list) and content:
        texts = [_part(part, f"{param}.content[{i}]", role) for i, part in enumerate(content)]
    else:
        raise InvalidRequest(
            f"{param}.content must be a string or a non-empty list of parts.",
            param=f"{param}.content",
        )
    parts = [{"type": part_type, "text": t} for t in texts]
    if role == "assistant":
        parts = [{**p, "annotations": [], "logprobs": []} for p in parts]
    return {"id": ident, "type": "message", "role": role, "status": "completed", "content": parts}


def _part(part: Any, param: str, role: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    allowed = ("output_text", "input_text") if role == "assistant" else ("input_text",)
    if kind not in allowed:
        raise UnsupportedFeature(
            f"{param}.type must be {' or '.join(allowed)} (only text is supported), got "
            f"{_short(kind)}.",
            param=f"{param}.type",
        )
    text = part.get("text")
    if not isinstance(text, str):
        raise InvalidRequest(f"{param}.text must be a string.", param=f"{param}.text")
    return text


# ---------------------------------------------------------------- the chat request


def messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Items as chat messages: an assistant's text and the function calls that follow it
    are one assistant message (the turn the model generated), a call's output a tool
    message."""
    out: list[dict[str, Any]] = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            text = "\n".join(part["text"] for part in item["content"])
            out.append({"role": item["role"], "content": text})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return out


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools, checked, as chat tools."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise UnsupportedFeature(
                f"tools[{i}].type must be function (the only tool this server runs), got "
                f"{_short(kind)}.",
                param=f"tools[{i}].type",
            )
        try:
            checked = FunctionToolParam.model_validate(tool)
        except ValidationError as exc:
            error = validation_error(exc)
            error.param = f"tools[{i}].{error.param}" if error.param else f"tools[{i}]"
            raise error from None
        function = checked.model_dump(exclude_none=True, exclude={"type"})
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and set(choice)
        == {
            "type",
            "name",
        }
    ):
        if isinstance(choice["name"], str) and choice["name"]:
            return {"type": "function", "function": {"name": choice["name"]}}
    raise UnsupportedFeature(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}, '
        f"got {_short(choice)}.",
        param="tool_choice",
    )


def response_format(text: TextParam | None) -> dict[str, Any] | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None or not fmt.name:
        raise InvalidRequest(
            "text.format of type json_schema needs a name and a schema.", param="text.format"
        )
    schema = {"name": fmt.name, "schema": fmt.schema_}
    if fmt.strict is not None:
        schema["strict"] = fmt.strict
    if fmt.description is not None:
        schema["description"] = fmt.description
    return {"type": "json_schema", "json_schema": schema}


@dataclass
class Translation:
    chat: dict[str, Any]  # the chat request body the worker runs
    stored: dict[str, Any]  # `JobRecord.responses`


def translate(req: ResponseRequest, response_id: str, context: list[dict[str, Any]]) -> Translation:
    """The chat request of `req` (whose previous response's conversation is `context`),
    and the Responses request the record keeps."""
    items = input_items(req.input, response_id)
    chat_messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    chat_messages += messages([*context, *items])
    chat: dict[str, Any] = {"model": req.model, "messages": chat_messages}
    optional = {
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": chat_tools(req.tools),
        "tool_choice": chat_tool_choice(req.tool_choice),
        "response_format": response_format(req.text),
        "metadata": req.metadata,
        "user": req.user,
        "safety_identifier": req.safety_identifier,
    }
    chat.update({k: v for k, v in optional.items() if v is not None})
    if req.tools:
        chat["parallel_tool_calls"] = req.parallel_tool_calls
    if req.priority:
        chat["priority"] = req.priority
    text = None
    if req.text is not None and req.text.format is not None:
        text = {"format": req.text.format.model_dump(exclude_none=True, by_alias=True)}
    stored = {
        "input": items,
        "context": context,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "tools": [{"type": "function", **t["function"]} for t in chat.get("tools") or []],
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "parallel_tool_calls": req.parallel_tool_calls,
        "text": text or {"format": {"type": "text"}},
        "metadata": req.metadata or {},
        "previous_response_id": req.previous_response_id,
        "background": req.background,
        "store": req.store,
        "stream": req.stream,
        "service_tier": req.tier,
        "user": req.user,
    }
    return Translation(chat, stored)


# chat parameter names as a Responses client knows them, for the errors of the chat request
_PARAMS = {
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "messages": "input",
    "tools": "tools",
}


def responses_error(error: InvalidRequest) -> InvalidRequest:
    """A 400 of the translated chat request, re-worded for the Responses request."""
    param = error.param or ""
    head = param.split(".")[0].split("[")[0]
    if head in _PARAMS:
        error.param = _PARAMS[head] + param[len(head) :] if head != "messages" else "input"
        error.message = str(error.message).replace(head, _PARAMS[head], 1)
    return error
