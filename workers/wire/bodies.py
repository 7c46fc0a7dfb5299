"""The OpenAI bodies a job answers with: completions, chat completions, embeddings, errors.

Workers build every result body from these models (`workers.responses`), the `done` event
and the job record carry it, and the API serves it as is; `/openapi.json` documents the
same models (`api.responses` re-exports them beside the API's other bodies), so what is
documented is what is built. They allow extra fields: a body may carry more than is
documented (`usage.prompt_tokens_details`), never less. `dump` leaves out what the builder
did not set, so an optional field is absent, not null, unless a builder says null.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    def dump(self) -> dict[str, Any]:
        """The JSON object of this body, with only the fields its builder set."""
        return self.model_dump(exclude_unset=True)


class ErrorDetail(Body):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorBody(Body):
    """Every error, whatever its status: OpenAI's shape."""

    error: ErrorDetail


class Usage(Body):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int


class CompletionChoice(Body):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class Completion(Body):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(Body):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(Body):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class ChatCompletion(Body):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Embedding(Body):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str = Field(description="floats, or base64 of little-endian f32")


class EmbeddingList(Body):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: Usage
