"""The OpenAI bodies a job answers with: completions, chat completions, embeddings, errors;
and the file and batch objects of the Batch API, built from their records.

Workers build every result body from these models (`workers.result_bodies`), the `done` event
and the job record carry it, and the API serves it as is; `/openapi.json` documents the
same models (`api.bodies` re-exports them beside the API's other bodies), so what is
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
    # a thinking model's: {"reasoning_tokens": generated tokens inside its thinking}
    completion_tokens_details: dict[str, int] | None = None


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
    reasoning_content: str | None = None  # vLLM's and llama.cpp's name for the thinking
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


# ---------------------------------------------------------------- files and batches
# (the records in `workers.wire.batches` build their OpenAI objects from these)


class FileObject(Body):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    expires_at: int | None
    filename: str
    purpose: str
    status: str
    status_details: str | None


class RequestCounts(Body):
    total: int
    completed: int
    failed: int


class BatchUsage(Body):
    """Tokens of the batch's lines so far, in the Responses API's usage layout (OpenAI's)."""

    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class Batch(Body):
    id: str
    object: Literal["batch"]
    endpoint: str
    model: str | None = Field(description="the model its lines name (one per batch)")
    errors: dict[str, Any] | None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    usage: BatchUsage
    metadata: dict[str, str] | None
