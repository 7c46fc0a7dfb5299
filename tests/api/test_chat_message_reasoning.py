"""A past answer's thinking sent back in the history (`reasoning_content` of an assistant
message, as this API returns it): accepted on assistant turns and carried to the worker,
whose chat template decides what the model sees (tests/runtime/test_chat_formats.py)."""

from __future__ import annotations

import pytest

from api.errors import InvalidRequest
from api.schemas import parse_request
from workers.wire.job import CHAT_COMPLETIONS


def body(message: dict) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "Hi"}, message]}


def test_an_assistant_turns_thinking_reaches_the_spec():
    turn = {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."}
    spec = parse_request(CHAT_COMPLETIONS, body(turn)).to_spec()
    assert spec.messages[1]["reasoning_content"] == "Greet back."


def test_only_assistant_turns_carry_thinking():
    turn = {"role": "user", "content": "Hello!", "reasoning_content": "x"}
    with pytest.raises(InvalidRequest, match="reasoning_content"):
        parse_request(CHAT_COMPLETIONS, body(turn))
