"""Pydantic wire models for the OpenAI-compatible endpoints, and their validation errors.

Validation is strict (vLLM's habit): a bool is never an int, numbers must be finite, strings
are not coerced to numbers, and range errors name the field and the value
(`top_p must be in (0, 1], got 1.5.`). Unknown fields are rejected with OpenAI's own
message (`Unrecognized request argument supplied: foo`) so that a typo such as `max_token`
is never silently ignored. Contract features the engine cannot honour yet (`suffix`,
...) are rejected as `UnsupportedFeature` rather than dropped. Structured output
(`response_format`, `json_schema`, `regex`, `grammar`) is compiled by llguidance here, at
submission, so a bad schema is a 400 with llguidance's message and never a failed job.

`to_spec()` gives what the worker generates (`runtime.request.GenerationSpec`), stored in
the job record; `to_job_request()` gives the normalised body stored beside it:
`stop` is always a list, chat message content is a string (absent only for an assistant
message that calls tools), chat `max_tokens` is the effective limit (`max_completion_tokens`
wins), and unset optional fields are omitted.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from api.errors import InvalidRequest, UnsupportedFeature
from runtime.constraints import Constraint, validate_constraint
from runtime.errors import LLMQRuntimeError
from runtime.limits import (  # the engine's own numbers
    MAX_CHOICES,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
)
from runtime.request import GenerationSpec, adapter_list, prompt_list
from runtime.sampling import SamplingParams
from workers import keys

MAX_N = 16
MAX_PROMPTS = 64  # prompts in one completion request; choices = prompts * n <= MAX_CHOICES
MAX_EMBEDDING_INPUTS = 256
MAX_TOKENS_LIMIT = 131072  # absolute cap; the model's context length is checked when known
MAX_MODEL_ID_CHARS = 256
MAX_USER_CHARS = 256
INT64 = 2**63


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


def _in_range(name: str, value: float, low: float, high: float, *, open_low: bool = False):
    ok = (low < value if open_low else low <= value) and value <= high
    if not ok:
        bracket = "(" if open_low else "["
        raise ValueError(f"{name} must be in {bracket}{_num(low)}, {_num(high)}], got {value}.")
    return value


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _text_list(name: str, value: Any, *, max_items: int, allow_empty: bool = False) -> list[str]:
    """A string or a non-empty list of strings, as a list."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
        raise ValueError(f"{name} must be a string or a list of strings, got {_short(value)}.")
    if not items:
        raise ValueError(f"{name} must not be empty.")
    if len(items) > max_items:
        raise ValueError(f"{name} must have at most {max_items} items, got {len(items)}.")
    if not allow_empty and any(not v.strip() for v in items):
        raise ValueError(f"{name} must not be empty or whitespace only.")
    return items


def _prompt_forms(name: str, value: Any, max_items: int) -> Any:
    """OpenAI's four prompt forms, checked: a string, a list of strings, a list of token
    ids, or a list of lists of token ids (ids are checked against the vocabulary later).
    An explicit null is refused here in the words a missing field gets (`reject_unsupported`)."""
    if value is None:
        raise ValueError(f"{name} is required.")
    if isinstance(value, list) and value and all(_is_int(t) for t in value):
        _token_ids(name, value)
        return value
    if isinstance(value, list) and value and all(isinstance(p, list) for p in value):
        if len(value) > max_items:
            raise ValueError(f"{name} must have at most {max_items} items, got {len(value)}.")
        for i, ids in enumerate(value):
            _token_ids(f"{name}[{i}]", ids)
        return value
    items = _text_list(name, value, max_items=max_items)
    return value if isinstance(value, str) else items


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(name: str, ids: Any) -> None:
    if not ids:
        raise ValueError(f"{name} must not be empty.")
    if not all(_is_int(t) and 0 <= t < 2**31 for t in ids):
        raise ValueError(f"{name} must be a list of token ids (non-negative integers).")


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_priority(priority: int) -> int:
    """`priority` as vLLM takes it (lower is served sooner), bounded to what the queues order
    exactly (`workers.keys.PRIORITY_MIN`/`PRIORITY_MAX`)."""
    if not keys.PRIORITY_MIN <= priority <= keys.PRIORITY_MAX:
        raise ValueError(
            f"priority must be an integer in [{keys.PRIORITY_MIN}, {keys.PRIORITY_MAX}], "
            f"got {priority}."
        )
    return priority


MAX_METADATA_PAIRS = 16  # OpenAI's limits on `metadata`
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512

# Fields of OpenAI's request types that change nothing here, accepted so that clients
# written for OpenAI work unchanged (README: "Fields accepted and ignored"): storage and
# routing hints of OpenAI's service, and hints for reasoning or predicted-output models.
# They are not stored; `metadata` is, and a job shows it (`GET /v1/jobs/{id}`).
IGNORED_FIELDS = (
    "store",
    "service_tier",
    "reasoning_effort",
    "verbosity",
    "prediction",
    "prompt_cache_key",
    "prompt_cache_retention",
    "safety_identifier",
    "modalities",
    "audio",
    "web_search_options",
)


def check_metadata(v: dict[str, str] | None) -> dict[str, str] | None:
    """OpenAI's limits on `metadata` (a chat request's, a response's)."""
    if v is not None and len(v) > MAX_METADATA_PAIRS:
        raise ValueError(f"metadata must have at most {MAX_METADATA_PAIRS} pairs, got {len(v)}.")
    for key, value in (v or {}).items():
        if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
            raise ValueError(
                f"metadata keys are at most {MAX_METADATA_KEY_CHARS} characters and values "
                f"at most {MAX_METADATA_VALUE_CHARS}."
            )
    return v


# A field checked the same way in every request that has it: the type carries the check
Priority = Annotated[int, AfterValidator(_check_priority)]
Metadata = Annotated[dict[str, str] | None, AfterValidator(check_metadata)]


class StreamOptions(StrictModel):
    include_usage: bool = False


# field -> (low, high, whether `low` itself is refused), each checked by `_in_range`
_SAMPLING_RANGES: dict[str, tuple[float, float, bool]] = {
    "n": (1, MAX_N, False),
    "temperature": (0, 2, False),
    "top_p": (0, 1, True),
    "min_p": (0, 1, False),
    "repetition_penalty": (0, 10, True),
    "presence_penalty": (-MAX_PENALTY, MAX_PENALTY, False),
    "frequency_penalty": (-MAX_PENALTY, MAX_PENALTY, False),
}
_ENGINE = SamplingParams()  # the engine's defaults are the request's: one home for them


class SamplingRequest(StrictModel):
    """Fields shared by completions and chat completions."""

    model: str = Field(min_length=1, max_length=MAX_MODEL_ID_CHARS)
    n: int = 1
    temperature: float = _ENGINE.temperature
    top_p: float = _ENGINE.top_p
    top_k: int = _ENGINE.top_k
    min_p: float = _ENGINE.min_p
    repetition_penalty: float = _ENGINE.repetition_penalty
    presence_penalty: float = _ENGINE.presence_penalty
    frequency_penalty: float = _ENGINE.frequency_penalty
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: Any = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=MAX_USER_CHARS)
    store: bool | None = None
    metadata: Metadata = None
    service_tier: str | None = None
    safety_identifier: str | None = Field(default=None, max_length=MAX_USER_CHARS)
    prompt_cache_key: str | None = None
    cache_prompt: bool = True
    ignore_eos: bool = False  # vLLM's extension; the engine supports it
    priority: Priority = 0
    # LoRA adapters [{"name", "scale"}], read by the engine's `adapter_list`; which ones
    # exist is checked at submission (`api.loras.resolve`)
    lora: Any = None
    # structured output (extensions; chat also has response_format), read by the engine's
    # `constraint_from_request` in `to_spec`
    json_schema: Any = None
    regex: Any = None
    grammar: Any = None

    @field_validator(*_SAMPLING_RANGES)
    @classmethod
    def _in_bounds(cls, v: float, info: ValidationInfo) -> float:
        low, high, open_low = _SAMPLING_RANGES[info.field_name]
        return _in_range(info.field_name, v, low, high, open_low=open_low)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or at least 1, got {v}.")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {_short(key)}.")
            _in_range(f"logit_bias[{key}]", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        return v

    @field_validator("seed")
    @classmethod
    def _int64(cls, v: int | None, info: Any) -> int | None:
        if v is not None and not -INT64 <= v < 2 * INT64:
            raise ValueError(f"{info.field_name} must fit in 64 bits, got {v}.")
        return v

    @field_validator("lora", mode="before")
    @classmethod
    def _lora(cls, v: Any) -> list[dict[str, Any]] | None:
        if v is None:
            return None
        try:
            return adapter_list(v)
        except LLMQRuntimeError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> list[str] | None:
        if v is None:
            return None
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise ValueError(f"stop must be a string or a list of strings, got {_short(v)}.")
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(
                f"stop must have at most {MAX_STOP_STRINGS} strings, got {len(items)}."
            )
        for item in items:
            if not item:
                raise ValueError("stop strings must be non-empty, got ''.")
            if len(item) > MAX_STOP_STRING_CHARS:
                raise ValueError(
                    f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters, "
                    f"got one of {len(item)}."
                )
        return list(dict.fromkeys(items))

    @property
    def choices(self) -> int:
        return self.n

    def param_name(self, name: str) -> str:
        """A field as the client's request calls it, for an error found later (the context,
        a rate limit): its own name here; a response's chat request names its own field."""
        return name

    def reject_unsupported(self) -> None:
        """Raise `UnsupportedFeature` for any contract feature the engine lacks."""
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest(
                "stream_options is only allowed when stream is true.", param="stream_options"
            )
        if self.choices > MAX_CHOICES:
            raise InvalidRequest(
                f"n times the number of prompts must be at most {MAX_CHOICES}, got {self.choices}.",
                param="n",
            )
        self.check_constraint()

    def check_constraint(self) -> None:
        """Compile the requested constraint (no model needed), so a bad schema, regex,
        grammar or tool `parameters` is a 400 with llguidance's message before any job
        exists."""
        spec = self.to_spec()
        try:
            for i, tool in enumerate(spec.tools or []):  # each schema alone: a short message
                parameters = tool["function"].get("parameters")
                if parameters is not None:
                    check = Constraint("json_schema", parameters, param="tools")
                    try:
                        validate_constraint(check)
                    except LLMQRuntimeError as exc:
                        raise InvalidRequest(
                            f"tools[{i}].function.parameters: {exc}", param="tools"
                        ) from None
            constraint = spec.output_constraint()  # the response format, or tool calls
            if constraint is not None:
                validate_constraint(constraint)
        except LLMQRuntimeError as exc:
            raise InvalidRequest(str(exc), param=exc.param) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def to_job_request(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True, exclude=set(IGNORED_FIELDS))

    def to_spec(self) -> GenerationSpec:
        """What the worker generates: the engine's own reader applied to the normalised body,
        so the API and the worker cannot disagree on what a field means."""
        try:
            return GenerationSpec.from_body(
                self.to_job_request(), chat=isinstance(self, ChatCompletionRequest)
            )
        except LLMQRuntimeError as exc:
            raise InvalidRequest(str(exc), param=exc.param) from None


def _max_tokens(v: int | None, info: ValidationInfo) -> int | None:
    name = info.field_name
    if v is not None and not 1 <= v <= MAX_TOKENS_LIMIT:
        if v < 1:
            raise ValueError(f"{name} must be at least 1, got {v}.")
        raise ValueError(f"{name} must be at most {MAX_TOKENS_LIMIT}, got {v}.")
    return v


# completions' max_tokens, chat's max_tokens and max_completion_tokens, a response's
# max_output_tokens
MaxTokens = Annotated[int | None, AfterValidator(_max_tokens)]


class CompletionRequest(SamplingRequest):
    prompt: Any = None
    max_tokens: MaxTokens = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: Any = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        return _prompt_forms("prompt", v, MAX_PROMPTS)

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: int | None) -> int | None:
        return v if v is None else _in_range("logprobs", v, 0, MAX_LOGPROBS)

    @property
    def prompts(self) -> list[Any]:
        """Each prompt: a string or a list of token ids."""
        return prompt_list(self.prompt, "prompt")

    @property
    def choices(self) -> int:
        return self.n * len(self.prompts)

    def reject_unsupported(self) -> None:
        if self.prompt is None:
            raise InvalidRequest("prompt is required.", param="prompt")
        super().reject_unsupported()
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedFeature("best_of other than n is not supported yet.", param="best_of")
        if self.suffix is not None:
            raise UnsupportedFeature("suffix is not supported yet.", param="suffix")


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ToolCallFunction(StrictModel):
    name: str = Field(min_length=1, max_length=64)
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(StrictModel):
    """A call an assistant message made (the history of a tool-calling conversation)."""

    id: str = Field(min_length=1, max_length=MAX_USER_CHARS)
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = Field(default=None, validate_default=True)
    name: str | None = Field(default=None, max_length=MAX_USER_CHARS)
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=128)
    tool_call_id: str | None = Field(default=None, max_length=MAX_USER_CHARS)
    refusal: str | None = None  # OpenAI echoes it in assistant messages; not shown
    # a past answer's thinking, as this API returned it (vLLM's and llama.cpp's name): the
    # chat template decides whether the model sees it (Qwen3's and gpt-oss's do, for turns
    # of the current exchange)
    reasoning_content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> str | None:
        """OpenAI allows a list of parts; only text parts exist here, joined with newlines.
        None only for an assistant message that calls tools (checked below)."""
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list):
            texts = []
            for part in v:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(
                        f"only text content parts are supported, got type {_short(kind)}."
                    )
                texts.append(TextPart.model_validate(part).text)
            return "\n".join(texts)
        raise ValueError(f"content must be a string or a list of text parts, got {_short(v)}.")

    @model_validator(mode="after")
    def _roles(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only for tool calls).")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages may have tool_calls.")
        if self.reasoning_content is not None and self.role != "assistant":
            raise ValueError("only assistant messages may have reasoning_content.")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers.")
        return self

    @property
    def text(self) -> str:
        return self.content or ""


class FunctionDefinition(StrictModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # arguments always follow `parameters` here


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Any = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_tokens: MaxTokens = None
    max_completion_tokens: MaxTokens = None
    response_format: ResponseFormat | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    prediction: Any = None
    prompt_cache_retention: str | None = None
    modalities: list[str] | None = None
    audio: Any = None
    web_search_options: Any = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None) -> int | None:
        return v if v is None else _in_range("top_logprobs", v, 0, MAX_LOGPROBS)

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def reject_unsupported(self) -> None:
        super().reject_unsupported()
        if all(not m.text.strip() and not m.tool_calls for m in self.messages):
            raise InvalidRequest("messages must contain some non-empty content.", param="messages")
        for name in ("functions", "function_call"):  # OpenAI's deprecated forms of tools
            if getattr(self, name) is not None:
                raise UnsupportedFeature(
                    f"{name} is not supported; use tools and tool_choice.", param=name
                )
        if self.modalities is not None and self.modalities != ["text"]:
            raise UnsupportedFeature(
                f"modalities other than ['text'] are not supported, got {self.modalities}.",
                param="modalities",
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true.", param="top_logprobs")

    def to_job_request(self) -> dict[str, Any]:
        body = self.model_dump(
            exclude_none=True,
            exclude={
                *IGNORED_FIELDS,
                "functions",
                "function_call",
                "max_completion_tokens",
            },
        )
        if self.effective_max_tokens is not None:
            body["max_tokens"] = self.effective_max_tokens
        return body


class EmbeddingRequest(StrictModel):
    model: str = Field(min_length=1, max_length=MAX_MODEL_ID_CHARS)
    input: Any = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = Field(default=None, max_length=MAX_USER_CHARS)
    priority: Priority = 0

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v: Any) -> Any:
        return _prompt_forms("input", v, MAX_EMBEDDING_INPUTS)

    @property
    def stream(self) -> bool:
        return False

    def to_spec(self) -> None:
        """Embeddings generate nothing: the worker reads `input` from the stored body."""
        return None

    @property
    def include_usage(self) -> bool:
        return False

    def reject_unsupported(self) -> None:
        if self.input is None:
            raise InvalidRequest("input is required.", param="input")
        if self.dimensions is not None:
            raise UnsupportedFeature("dimensions is not supported yet.", param="dimensions")

    def to_job_request(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True, exclude={"dimensions"})


REQUEST_MODELS: dict[str, type[StrictModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/embeddings": EmbeddingRequest,
}

_TYPE_WORDS = {
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "bool_type": "a boolean",
    "list_type": "a list",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "finite_number": "a finite number",
}


def _param(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts)


def validation_error(exc: ValidationError, loc: tuple[Any, ...] | None = None) -> InvalidRequest:
    """The first pydantic error as one 400 with a message naming the field and value;
    `loc`: the field's place as the caller names it (a union's member names left out)."""
    err = exc.errors(include_url=False)[0]
    param = _param(err["loc"] if loc is None else loc) or None
    kind = err["type"]
    if kind == "extra_forbidden":
        return InvalidRequest(f"Unrecognized request argument supplied: {param}", param=param)
    if kind == "missing":
        return InvalidRequest(f"{param} is required.", param=param)
    if kind == "value_error" and "error" in err.get("ctx", {}):
        return InvalidRequest(str(err["ctx"]["error"]), param=param)
    if kind in _TYPE_WORDS:
        message = f"{param} must be {_TYPE_WORDS[kind]}, got {_short(err.get('input'))}."
        return InvalidRequest(message, param=param)
    return InvalidRequest(f"{param}: {err['msg']}.", param=param)


def parse_request(endpoint: str, body: dict[str, Any]) -> Any:
    """Validate `body` for `endpoint`; raises `InvalidRequest` / `UnsupportedFeature`."""
    try:
        req = REQUEST_MODELS[endpoint].model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
    req.reject_unsupported()
    return req
