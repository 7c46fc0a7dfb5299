"""Turning job events into OpenAI streaming chunks (`chat.completion.chunk`, `text_completion`).

Per choice: chat streams first send `delta: {"role": "assistant", "content": ""}`, then one
chunk per token event with its text; the finish chunk per choice comes from the `done`
result (its `finish_reason`), then an optional usage chunk with empty `choices`.
Token events with empty text (an incomplete UTF-8 character) produce no chunk. A chat job
that may call tools sends each token's `delta` ready-made (content, and OpenAI's
`tool_calls` deltas: index, id, type and name once, then argument fragments); the chunk
carries it as it is, so the tags of a call never reach the client as content.
"""

from __future__ import annotations

import json
from typing import Any

from workers.wire.events import StreamToken
from workers.wire.job import CHAT_COMPLETIONS, JobRecord, response_id

# Where a token's text goes in a prebuilt chunk (`ChunkStream.token_message`): control
# characters are escaped by json.dumps, so no text's JSON contains this one's
_TEXT_SLOT = "\x00llmq-token-text\x00"
_TEXT_SLOT_JSON = json.dumps(_TEXT_SLOT)


def sse_data(payload: dict[str, Any]) -> str:
    """One SSE message carrying `payload` as JSON (which holds no line break)."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class ChunkStream:
    """Builds the chunks of one streamed response; holds only per-response state."""

    def __init__(self, record: JobRecord, request: Any) -> None:
        self.chat = record.endpoint == CHAT_COMPLETIONS
        self.object = "chat.completion.chunk" if self.chat else "text_completion"
        self.id = response_id(record.endpoint, record.id)
        self.created = int(record.created_at)
        self.model = record.responds_as  # an adapter named as the model: the adapter
        self.include_usage = request.include_usage
        self.logprobs = bool(request.logprobs) if self.chat else request.logprobs is not None
        self.choices = request.choices
        self.prompts = [] if self.chat else request.prompts
        self.echo = False if self.chat else request.echo
        self.n = request.n
        self.offsets = [0] * self.choices  # text_offset per choice, for completion logprobs
        self._token_templates: dict[int, tuple[str, str]] = {}  # choice -> around the text

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _choice(self, index: int, text: str, finish: str | None, logprobs: Any = None):
        if self.chat:
            delta: dict[str, Any] = {"content": text} if text or finish is None else {}
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def start(self) -> list[dict[str, Any]]:
        """Chunks sent before any token: the assistant role, or the echoed prompt."""
        if self.chat:
            return [
                self._chunk(
                    [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
                for i in range(self.choices)
            ]
        if self.echo:
            chunks = []
            for i in range(self.choices):
                prompt = self.prompts[i // self.n]
                self.offsets[i] = len(prompt)
                chunks.append(self._chunk([self._choice(i, prompt, None)]))
            return chunks
        return []

    def token(self, event: StreamToken) -> dict[str, Any] | None:
        text = event.text
        delta = event.delta if self.chat else None
        if delta is not None:
            return self._parsed_token(event, delta)
        if not text and not self.logprobs:
            return None
        logprobs = self._logprobs(event) if self.logprobs else None
        return self._chunk([self._choice(event.choice, text, None, logprobs)])

    def token_message(self, event: StreamToken) -> str | None:
        """`token`'s chunk as its SSE message. A plain text token (most of a stream) fills
        its choice's prebuilt message instead of building and encoding the chunk: the
        relay's cost per token is what bounds the tokens a second one API carries."""
        if self.logprobs or (self.chat and event.delta is not None):
            chunk = self.token(event)
            return None if chunk is None else sse_data(chunk)
        if not event.text:
            return None
        before, after = self._token_template(event.choice)
        return before + json.dumps(event.text, ensure_ascii=False) + after

    def _token_template(self, index: int) -> tuple[str, str]:
        template = self._token_templates.get(index)
        if template is None:
            message = sse_data(self._chunk([self._choice(index, _TEXT_SLOT, None)]))
            before, after = message.split(_TEXT_SLOT_JSON)
            template = self._token_templates[index] = (before, after)
        return template

    def _parsed_token(self, event: StreamToken, delta: dict[str, Any]) -> dict[str, Any] | None:
        """A chat token whose worker split it into content and tool-call deltas."""
        if not delta and not self.logprobs:
            return None
        logprobs = self._logprobs(event) if self.logprobs else None
        choice = {
            "index": event.choice,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": None,
        }
        return self._chunk([choice])

    def _logprobs(self, event: StreamToken) -> dict[str, Any]:
        """The chunk's `logprobs`: the worker's ready-made entry, else a minimal one."""
        entry, text, index = event.logprobs, event.text, event.choice
        if self.chat:
            if entry is None:
                entry = {
                    "token": text,
                    "logprob": event.logprob,
                    "bytes": list(text.encode()),
                    "top_logprobs": [],
                }
            return {"content": [entry]}
        offset = self.offsets[index] if index < len(self.offsets) else 0
        if index < len(self.offsets):
            self.offsets[index] += len(text)
        if entry is None:
            entry = {"token": text, "logprob": event.logprob, "top_logprobs": None}
        return {
            "tokens": [entry.get("token", text)],
            "token_logprobs": [entry.get("logprob")],
            "top_logprobs": [entry.get("top_logprobs")],
            "text_offset": [entry.get("text_offset", offset)],
        }

    def done(self, result: dict[str, Any]) -> list[dict[str, Any]]:
        """Finish chunks for every choice, then the usage chunk if it was asked for."""
        finishes = {
            int(c.get("index", i)): c.get("finish_reason") or "stop"
            for i, c in enumerate(result.get("choices") or [])
        }
        chunks = [
            self._chunk([self._choice(i, "", finishes.get(i, "stop"))]) for i in range(self.choices)
        ]
        if self.include_usage:
            usage = self._chunk([])
            usage["usage"] = result.get("usage")
            chunks.append(usage)
        return chunks
