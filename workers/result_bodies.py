"""OpenAI response bodies, built from what the choices of a job produced.

A job's `done` event carries exactly the body the synchronous call returns, so these
functions are the single source of that shape, and they build it through the pydantic
models that `/openapi.json` documents (`workers.wire.bodies`): a body that does not match
its documented schema fails here, in the worker, not in a client. Per-token logprob entries
are rendered once, when the token is generated, in the endpoint's own layout; the same
entry goes into the token event (the API streams it as is) and, at the end, into the body.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from runtime.tokenizer import Tokenizer
from workers.wire.bodies import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    Completion,
    CompletionChoice,
    Embedding,
    EmbeddingList,
    Usage,
)
from workers.wire.job import CHAT_COMPLETIONS, COMPLETIONS, response_id


@dataclass
class ChoiceOutput:
    """What one choice produced so far (including tokens streamed by an earlier attempt)."""

    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    tokens: int = 0
    finish_reason: str | None = None
    echo_text: str = ""
    echo_logprobs: list[dict[str, Any]] = field(default_factory=list)
    # a chat answer parsed for tool calls (`runtime.tool_calls`): its content (None when it
    # only calls tools) and calls; else the content is the text
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    parsed: bool = False
    # a thinking model's thinking, apart from the content (runtime/reasoning.py), and the
    # tokens it took (None: the answer was not parsed for thinking)
    reasoning_content: str | None = None
    reasoning_tokens: int | None = None

    @property
    def text_length(self) -> int:
        return len(self.echo_text) + sum(len(t) for t in self.text)


class LogprobRenderer:
    """Renders token logprobs as OpenAI does for one endpoint (legacy or chat layout)."""

    def __init__(self, tokenizer: Tokenizer, endpoint: str) -> None:
        self.tokenizer = tokenizer
        self.endpoint = endpoint

    def token_bytes(self, token_id: int) -> bytes:
        return self.tokenizer.piece_bytes(token_id, skip_special=False)

    def token_text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def entry(
        self,
        token_id: int,
        logprob: float | None,
        top: Sequence[tuple[int, float]],
        text_offset: int,
    ) -> dict[str, Any]:
        if self.endpoint == CHAT_COMPLETIONS:
            return {
                **self._chat_token(token_id, logprob),
                "top_logprobs": [self._chat_token(t, lp) for t, lp in top],
            }
        alternatives = None
        if logprob is not None:  # the sampled token is always listed (up to N + 1 entries)
            alternatives = {self.token_text(t): lp for t, lp in top}
            alternatives.setdefault(self.token_text(token_id), logprob)
        return {
            "token": self.token_text(token_id),
            "logprob": logprob,
            "top_logprobs": alternatives,
            "text_offset": text_offset,
        }

    def echo_entries(
        self, scored: Sequence[tuple[int, float | None, Sequence[tuple[int, float]]]]
    ) -> list[dict[str, Any]]:
        """Entries for echoed prompt tokens; the first token has no logprob (null)."""
        entries, offset = [], 0
        for token_id, logprob, top in scored:
            entries.append(self.entry(token_id, logprob, top, offset))
            offset += len(self.token_text(token_id))
        return entries

    def _chat_token(self, token_id: int, logprob: float | None) -> dict[str, Any]:
        raw = self.token_bytes(token_id)
        return {
            "token": raw.decode("utf-8", errors="replace"),
            "logprob": logprob,
            "bytes": list(raw),
        }


def usage(
    prompt_tokens: int, completion_tokens: int | None = None, cached_tokens: int | None = None
) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens` (prompt tokens the prefix cache served) goes in
    `prompt_tokens_details` as OpenAI reports prompt caching."""
    return _usage(prompt_tokens, completion_tokens, cached_tokens).dump()


def _usage(
    prompt_tokens: int,
    completion_tokens: int | None,
    cached_tokens: int | None,
    reasoning_tokens: int | None = None,
) -> Usage:
    fields: dict[str, Any] = {"prompt_tokens": prompt_tokens}
    if completion_tokens is not None:
        fields["completion_tokens"] = completion_tokens
    if reasoning_tokens is not None:
        fields["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    fields["total_tokens"] = prompt_tokens + (completion_tokens or 0)
    if cached_tokens is not None:
        fields["prompt_tokens_details"] = {"cached_tokens": min(cached_tokens, prompt_tokens)}
    return Usage(**fields)


def generation_body(
    endpoint: str,
    job_id: str,
    created: float,
    model: str,
    choices: Sequence[ChoiceOutput],
    prompt_tokens: int,
    logprobs: bool,
    cached_tokens: int = 0,
) -> dict[str, Any]:
    """The body of a completions or chat completions job (`endpoint`): the two share their
    id, timestamps and usage, and differ only in the object name and the choice layout."""
    head: dict[str, Any] = {
        "id": response_id(endpoint, job_id),
        "created": int(created),
        "model": model,
        "usage": _usage(
            prompt_tokens, sum(c.tokens for c in choices), cached_tokens, _reasoning(choices)
        ),
    }
    if endpoint == CHAT_COMPLETIONS:
        chat = [_chat_choice(c, logprobs) for c in choices]
        return ChatCompletion(object="chat.completion", choices=chat, **head).dump()
    text = [_completion_choice(c, logprobs) for c in choices]
    return Completion(object="text_completion", choices=text, **head).dump()


def _reasoning(choices: Sequence[ChoiceOutput]) -> int | None:
    """Generated tokens inside thinking, where an answer was parsed for it (OpenAI's
    `completion_tokens_details.reasoning_tokens`)."""
    counted = [c.reasoning_tokens for c in choices if c.reasoning_tokens is not None]
    return sum(counted) if counted else None


completion_body = partial(generation_body, COMPLETIONS)
chat_body = partial(generation_body, CHAT_COMPLETIONS)


def _completion_choice(c: ChoiceOutput, logprobs: bool) -> CompletionChoice:
    return CompletionChoice(
        index=c.index,
        text=c.echo_text + "".join(c.text),
        logprobs=_legacy_logprobs(c.echo_logprobs + c.logprobs) if logprobs else None,
        finish_reason=c.finish_reason,
    )


def _chat_choice(c: ChoiceOutput, logprobs: bool) -> ChatChoice:
    return ChatChoice(
        index=c.index,
        message=_message(c),
        logprobs={"content": c.logprobs} if logprobs else None,
        finish_reason=c.finish_reason,
    )


def _message(choice: ChoiceOutput) -> AssistantMessage:
    if not choice.parsed:
        return AssistantMessage(role="assistant", content="".join(choice.text))
    message = AssistantMessage(role="assistant", content=choice.content)
    if choice.reasoning_content is not None:
        message.reasoning_content = choice.reasoning_content
    if choice.tool_calls:
        message.tool_calls = choice.tool_calls
    return message


def embeddings_body(
    model: str, vectors: np.ndarray, prompt_tokens: int, encoding_format: str | None
) -> dict[str, Any]:
    """`encoding_format` "base64" is the little-endian float32 bytes, base64-encoded."""
    data = []
    for index, vector in enumerate(vectors):
        if encoding_format == "base64":
            embedding: Any = base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
        else:
            embedding = [float(x) for x in vector]
        data.append(Embedding(object="embedding", index=index, embedding=embedding))
    return EmbeddingList(
        object="list", data=data, model=model, usage=_usage(prompt_tokens, None, None)
    ).dump()


def _legacy_logprobs(entries: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [e["top_logprobs"] for e in entries],
        "text_offset": [e["text_offset"] for e in entries],
    }
