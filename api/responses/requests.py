"""A Responses API request (`POST /v1/responses`), typed, and the chat request a worker runs
(workers/wire/responses_api.py renders the answer).

`input` items, `tools` and `tool_choice` are pydantic unions told apart by `type`
(`InputItem`, `Tool`, `ToolChoice`), so a request is checked by its types, and an error
names the Responses field it is about (`input[2].content[0].type`), never the chat request's.
The translation (`ResponseRequest.to_chat_request`): `instructions` -> a system message
first (never carried over from a previous response, as OpenAI does); the previous
response's conversation (its context, input and output items) -> the messages after it, so
that a turn's prompt starts with the tokens the last turn ran and its prefix comes from the
prefix cache; then `input` -> messages; `max_output_tokens` -> `max_tokens`; flat function
tools and `tool_choice` -> chat's; `text.format` -> `response_format`; `service_tier` ->
llmq's integer `priority` (lower runs sooner). What the chat request checks later (the
context, a rate limit) is named by `ResponsesChatRequest.param_name`. Every field OpenAI
defines and llmq does not do is refused with a 400 naming it, never ignored.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
)
from pydantic_core import PydanticCustomError

from api.errors import APIError, InvalidRequest, UnsupportedFeature
from api.schemas import (
    MAX_MODEL_ID_CHARS,
    MAX_USER_CHARS,
    ChatCompletionRequest,
    ChatMessage,
    FunctionDefinition,
    MaxTokens,
    Metadata,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    StrictModel,
    _in_range,
    _short,
    validation_error,
)
from api.schemas import (
    Tool as ChatTool,
)
from runtime.constraints import Constraint, validate_constraint
from runtime.errors import LLMQRuntimeError
from workers.wire.responses_api import RESPONSE_ID_PREFIX, StoredRequest

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
# the chat request's fields as a Responses client knows them (`ResponsesChatRequest`)
CHAT_PARAMS = {
    "max_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
}


def new_response_id() -> str:
    return RESPONSE_ID_PREFIX + uuid.uuid4().hex


def _type_of(default: str | None = None):
    """The discriminator of a union told apart by `type` (`default` where it is absent)."""

    def tag(value: Any) -> str | None:
        if isinstance(value, dict):
            return value.get("type", default)
        return getattr(value, "type", None)

    return tag


# ---------------------------------------------------------------- input items


class _Part(StrictModel):
    model_config = ConfigDict(extra="ignore")  # a part's other fields (annotations) unread


class InputTextPart(_Part):
    type: Literal["input_text"]
    text: str


class OutputTextPart(_Part):
    type: Literal["output_text"]
    text: str


ContentPart = Annotated[
    Annotated[InputTextPart, Tag("input_text")] | Annotated[OutputTextPart, Tag("output_text")],
    Discriminator(_type_of()),
]
ItemId = Annotated[str, Field(min_length=1, max_length=128)]


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    id: ItemId | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: list[ContentPart] = Field(min_length=1)
    status: Any = None  # as the client echoes it; a stored item is always completed

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [{"type": "input_text", "text": v}]
        if not isinstance(v, list) or not v:
            raise PydanticCustomError("shape", "must be a string or a non-empty list of parts")
        return v

    def stored(self, ident: str, param: str) -> dict[str, Any]:
        """As the record keeps it: every part of the role's kind (an assistant's text is
        output_text, the others' input_text)."""
        kind = "output_text" if self.role == "assistant" else "input_text"
        allowed = ("output_text", "input_text") if self.role == "assistant" else ("input_text",)
        for i, part in enumerate(self.content):
            if part.type not in allowed:
                raise UnsupportedFeature(
                    f"{param}.content[{i}].type must be {' or '.join(allowed)} (only text is "
                    f"supported), got {part.type!r}.",
                    param=f"{param}.content[{i}].type",
                )
        parts: list[dict[str, Any]] = [{"type": kind, "text": p.text} for p in self.content]
        if self.role == "assistant":
            parts = [{**p, "annotations": [], "logprobs": []} for p in parts]
        return {
            "id": self.id or f"msg_{ident}",
            "type": "message",
            "role": self.role,
            "status": "completed",
            "content": parts,
        }


CallId = Annotated[str, Field(min_length=1, max_length=MAX_USER_CHARS)]  # as chat's


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    id: ItemId | None = None
    call_id: CallId
    name: str = Field(min_length=1, max_length=64)
    arguments: str
    status: Any = None

    def stored(self, ident: str, param: str) -> dict[str, Any]:
        fields = self.model_dump(include={"call_id", "name", "arguments"})
        return {"id": self.id or f"fc_{ident}", "type": self.type, **fields, "status": "completed"}


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    id: ItemId | None = None
    call_id: CallId
    output: str
    status: Any = None

    def stored(self, ident: str, param: str) -> dict[str, Any]:
        fields = self.model_dump(include={"call_id", "output"})
        return {"id": self.id or f"fco_{ident}", "type": self.type, **fields, "status": "completed"}


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_type_of("message")),  # an item without a type is a message
]

# ---------------------------------------------------------------- tools, format


class FunctionTool(StrictModel):
    """Responses' flat function tool (the only tool this server runs)."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


Tool = FunctionTool  # one kind so far: another is a tagged member here, as `InputItem`'s


class FunctionChoice(StrictModel):
    type: Literal["function"]
    name: str = Field(min_length=1)


ToolChoice = Literal["none", "auto", "required"] | FunctionChoice


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, max_length=64)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    def response_format(self) -> ResponseFormat | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return ResponseFormat(type="json_object")
        schema: dict[str, Any] = {"name": self.name, "schema": self.schema_}
        if self.strict is not None:
            schema["strict"] = self.strict
        if self.description is not None:
            schema["description"] = self.description
        return ResponseFormat(type="json_schema", json_schema=schema)


class TextParam(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only verbosity a non-reasoning model has


# ---------------------------------------------------------------- the request


class ResponsesChatRequest(ChatCompletionRequest):
    """The chat request a response runs as: a check made later, against the model (the
    context, a rate limit), names the field as the Responses request calls it."""

    def param_name(self, name: str) -> str:
        return CHAT_PARAMS.get(name, name)


class ResponseRequest(StrictModel):
    model: str = Field(min_length=1, max_length=MAX_MODEL_ID_CHARS)
    input: list[InputItem] = Field(min_length=1, max_length=MAX_INPUT_ITEMS)
    instructions: str | None = None
    max_output_tokens: MaxTokens = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    background: bool = False
    store: bool = True
    metadata: Metadata = None
    previous_response_id: str | None = Field(default=None, max_length=64)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextParam | None = None
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = Field(default=None, max_length=MAX_USER_CHARS)
    safety_identifier: str | None = Field(default=None, max_length=MAX_USER_CHARS)

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v: Any) -> Any:
        if isinstance(v, str):  # a string is one user message
            return [{"role": "user", "content": v}]
        if not isinstance(v, list) or not v:
            raise PydanticCustomError("shape", "must be a string or a non-empty list of items")
        return v

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

    @property
    def text_format(self) -> TextFormat | None:
        return self.text.format if self.text is not None else None

    def input_items(self, response_id: str) -> list[dict[str, Any]]:
        """`input` as the record keeps it: items with their ids (given, or made from the
        response id and the item's place)."""
        suffix = response_id.removeprefix(RESPONSE_ID_PREFIX)
        return [item.stored(f"{suffix}_in{i}", f"input[{i}]") for i, item in enumerate(self.input)]

    def to_stored(self, items: list[dict[str, Any]], context: list[dict[str, Any]]):
        """What the record keeps (`workers.wire.responses_api.StoredRequest`)."""
        fmt = self.text_format
        return StoredRequest(
            input=items,
            context=context,
            instructions=self.instructions,
            max_output_tokens=self.max_output_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            tools=[t.model_dump(exclude_none=True) for t in self.tools or []],
            tool_choice=(
                self.tool_choice.model_dump()
                if isinstance(self.tool_choice, FunctionChoice)
                else self.tool_choice or "auto"
            ),
            parallel_tool_calls=self.parallel_tool_calls,
            text={"format": fmt.model_dump(exclude_none=True, by_alias=True)}
            if fmt is not None
            else {"format": {"type": "text"}},
            metadata=self.metadata or {},
            previous_response_id=self.previous_response_id,
            background=self.background,
            store=self.store,
            stream=self.stream,
            service_tier=self.tier,
            user=self.user,
        )

    def to_chat_request(self, items: list[dict[str, Any]], context: list[dict[str, Any]]):
        """The chat request the worker runs: the instructions, the previous conversation
        (`context`) and this input (`items`, as `input_items` made them) as messages."""
        chat_messages = []
        if self.instructions:
            chat_messages.append(ChatMessage(role="system", content=self.instructions))
        chat_messages += [ChatMessage(**m) for m in messages([*context, *items])]
        if all(not m.text.strip() and not m.tool_calls for m in chat_messages):
            raise InvalidRequest("input must contain some non-empty content.", param="input")
        fields: dict[str, Any] = {
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "tools": self._chat_tools(),
            "tool_choice": self._chat_tool_choice(),
            "response_format": self._response_format(),
            "metadata": self.metadata,
            "user": self.user,
            "safety_identifier": self.safety_identifier,
            "parallel_tool_calls": self.parallel_tool_calls if self.tools else None,
            "priority": self.priority or None,
        }
        chat = ResponsesChatRequest(
            model=self.model,
            messages=chat_messages,
            **{k: v for k, v in fields.items() if v is not None},
        )
        chat.reject_unsupported()
        return chat

    def _chat_tools(self) -> list[ChatTool] | None:
        if self.tools is None:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            if tool.parameters is not None:
                _compiles(Constraint("json_schema", tool.parameters, param="tools"), f"tools[{i}]")
            function = FunctionDefinition(**tool.model_dump(exclude_none=True, exclude={"type"}))
            out.append(ChatTool(type="function", function=function))
        return out

    def _chat_tool_choice(self) -> Any:
        if isinstance(self.tool_choice, FunctionChoice):
            return NamedToolChoice(
                type="function", function=NamedFunction(name=self.tool_choice.name)
            )
        return self.tool_choice

    def _response_format(self) -> ResponseFormat | None:
        fmt = self.text_format
        if fmt is None:
            return None
        if fmt.type == "json_schema":
            if fmt.schema_ is None or not fmt.name:
                raise InvalidRequest(
                    "text.format of type json_schema needs a name and a schema.",
                    param="text.format",
                )
            _compiles(Constraint("json_schema", fmt.schema_, param="text.format"), "text.format")
        return fmt.response_format()


def _compiles(constraint: Constraint, what: str) -> None:
    """A schema the worker would refuse is a 400 naming its Responses field now."""
    try:
        validate_constraint(constraint)
    except LLMQRuntimeError as exc:
        raise InvalidRequest(f"{what}: {exc}", param=constraint.param) from None


# ---------------------------------------------------------------- parsing and errors

# the tags of the unions above, and pydantic's names of union members: not field names
_NOT_FIELDS = frozenset(
    {"message", "function_call", "function_call_output", "input_text", "output_text"}
    | {"function", "str"}
)


def _error(exc: ValidationError) -> APIError:
    """The first pydantic error as one 400 naming the Responses field: a `type` this
    server does not run is refused as unsupported."""
    err = exc.errors(include_url=False)[0]
    loc = tuple(p for p in err["loc"] if isinstance(p, int) or _is_field(p))
    param = validation_error(exc, loc=loc).param or ""
    kind = err["type"]
    if loc and loc[0] == "tool_choice":
        return UnsupportedFeature(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "name": '
            f"...}}, got {_short(exc.errors()[0]['input'])}.",
            param="tool_choice",
        )
    tag_error = kind in ("union_tag_invalid", "union_tag_not_found")
    if tag_error and not isinstance(err.get("input"), dict):
        return InvalidRequest(
            f"{param} must be an object, got {_short(err.get('input'))}.", param=param
        )
    if tag_error or (loc and loc[-1] == "type" and kind in ("literal_error", "missing")):
        where = param if tag_error else param.removesuffix(".type")
        got = err.get("ctx", {}).get("tag") if tag_error else err.get("input")
        got = None if kind == "missing" else got
        expected = _EXPECTED.get(_shape(loc if tag_error else loc[:-1]), "a supported type")
        return UnsupportedFeature(
            f"{where}.type must be {expected}, got {_short(got)}.", param=f"{where}.type"
        )
    if kind == "shape":
        return InvalidRequest(f"{param} {err['msg']}.", param=param)
    return validation_error(exc, loc=loc)


def _is_field(part: str) -> bool:
    return part not in _NOT_FIELDS and part.isidentifier()


def _shape(loc: tuple[Any, ...]) -> str:
    return ".".join("*" if isinstance(p, int) else p for p in loc)


_EXPECTED = {
    "input.*": "message, function_call or function_call_output",
    "input.*.content.*": "input_text or output_text (only text is supported)",
    "tools.*": "function (the only tool this server runs)",
}


def parse_response_request(body: dict[str, Any]) -> ResponseRequest:
    """Validate a `POST /v1/responses` body; raises `InvalidRequest` / `UnsupportedFeature`."""
    for name in UNSUPPORTED:
        if body.get(name) not in (None, [], {}):
            raise UnsupportedFeature(f"{name} is not supported by this server.", param=name)
    if body.get("input") is None:
        raise InvalidRequest("input is required.", param="input")
    try:
        req = ResponseRequest.model_validate(body)
    except ValidationError as exc:
        raise _error(exc) from None
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


# ---------------------------------------------------------------- the chat request


def messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stored items as chat messages: an assistant's text and the function calls that
    follow it are one assistant message (the turn the model generated), a call's output a
    tool message, a reasoning item nothing (a finished turn's thinking is left out of the
    prompt, as Qwen3's and gpt-oss's templates leave it)."""
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


@dataclass
class Translation:
    chat: ResponsesChatRequest  # the chat request the worker runs
    stored: StoredRequest  # `JobRecord.responses`


def translate(req: ResponseRequest, response_id: str, context: list[dict[str, Any]]) -> Translation:
    """The chat request of `req` (whose previous response's conversation is `context`),
    and the Responses request the record keeps."""
    items = req.input_items(response_id)
    return Translation(req.to_chat_request(items, context), req.to_stored(items, context))
