"""api/chunks.py: a plain token's prebuilt SSE message is byte for byte the chunk that the
dict path builds and encodes."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from api.chunks import ChunkStream, sse_data
from workers.wire.events import StreamToken
from workers.wire.job import CHAT_COMPLETIONS, COMPLETIONS

TEXTS = ["Hello", ' "quoted"\n', "é 日本語 \\ \t\x01", "", "\x00llmq"]


def chunk_stream(chat: bool, include_usage: bool, logprobs: bool = False) -> ChunkStream:
    record = SimpleNamespace(
        endpoint=CHAT_COMPLETIONS if chat else COMPLETIONS,
        id="job-1",
        created_at=1_764_000_000.5,
        responds_as="smollm2-135m-instruct",
    )
    request = SimpleNamespace(
        include_usage=include_usage,
        logprobs=(True if chat else 0) if logprobs else (False if chat else None),
        choices=3,
        prompts=["p"],
        echo=False,
        n=3,
    )
    return ChunkStream(record, request)


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("include_usage", [False, True])
def test_a_plain_token_message_equals_the_encoded_chunk(chat: bool, include_usage: bool):
    stream = chunk_stream(chat, include_usage)
    for choice in (0, 2, 0):
        for text in TEXTS:
            event = StreamToken(choice=choice, index=4, text=text, token_id=7)
            chunk = stream.token(event)
            message = stream.token_message(event)
            if chunk is None:  # an incomplete character: no chunk either way
                assert message is None and text == ""
                continue
            assert message == sse_data(chunk)
            assert message.startswith("data: ") and message.endswith("\n\n")
            decoded = json.loads(message[6:])
            got = decoded["choices"][0]["delta"]["content"] if chat else decoded["choices"][0]
            assert (got if chat else got["text"]) == text
            assert ("usage" in decoded) == include_usage


def test_tokens_with_logprobs_or_a_parsed_delta_take_the_chunk_path():
    # the chunk path keeps each choice's text offset: two streams, one call each
    by_message, by_chunk = (chunk_stream(False, False, logprobs=True) for _ in range(2))
    event = StreamToken(choice=1, index=0, text="Hi", token_id=5, logprob=-0.25)
    message = by_message.token_message(event)
    assert message == sse_data(by_chunk.token(event))
    assert json.loads(message[6:])["choices"][0]["logprobs"]["token_logprobs"] == [-0.25]
    chat = chunk_stream(chat=True, include_usage=False)
    call = {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}
    event = StreamToken(choice=0, index=0, text="{", token_id=5, delta=call)
    assert json.loads(chat.token_message(event)[6:])["choices"][0]["delta"] == call
