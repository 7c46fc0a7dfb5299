"""The Responses API on the real SmolLM2: a real server, a real worker process, the official
`openai` client (`smollm2_*` in tests/api/conftest.py)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.api.conftest import SMOLLM2 as MODEL

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RULES = "You are a helpful assistant. Answer in one short sentence."


def test_a_greedy_response_is_the_same_chat_completions_text(smollm2_oai) -> None:
    response = smollm2_oai.responses.create(
        model=MODEL,
        instructions=RULES,
        input="What is the capital of France?",
        temperature=0,
        max_output_tokens=24,
    )
    chat = smollm2_oai.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": RULES},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        temperature=0,
        max_tokens=24,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.output_text.strip()
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    finish = chat.choices[0].finish_reason
    assert response.status == ("incomplete" if finish == "length" else "completed")


def test_the_next_turn_hits_the_prefix_cache(smollm2_oai) -> None:
    first = smollm2_oai.responses.create(
        model=MODEL,
        instructions=RULES,
        input="My name is Ada and I like green tea. " * 6 + "Say hello to me.",
        temperature=0,
        max_output_tokens=16,
    )
    second = smollm2_oai.responses.create(
        model=MODEL,
        instructions=RULES,
        input="What is my name?",
        previous_response_id=first.id,
        temperature=0,
        max_output_tokens=16,
    )
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens
    cached = second.usage.input_tokens_details.cached_tokens
    # the first turn's prompt and the tokens it generated were cached, block by block
    assert first.usage.input_tokens // 2 < cached <= first.usage.total_tokens
    items = smollm2_oai.responses.input_items.list(second.id, order="asc")
    assert [i.type for i in items.data] == ["message"] * 3
    assert items.data[1].role == "assistant"


def test_a_forced_function_call_with_valid_arguments(smollm2_oai) -> None:
    weather = {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
            "additionalProperties": False,
        },
    }
    response = smollm2_oai.responses.create(
        model=MODEL,
        input="What is the weather like in Paris today?",
        tools=[weather],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=60,
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["get_weather"]
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    events = list(smollm2_oai.responses.retrieve(response.id, stream=True, starting_after=1))
    arguments = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [a.arguments for a in arguments] == [calls[0].arguments]
    assert events[-1].response.output[-1].id == calls[0].id


def test_text_format_json_schema_constrains_the_output(smollm2_oai) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
        "additionalProperties": False,
    }
    response = smollm2_oai.responses.create(
        model=MODEL,
        input="Describe the weather in Paris as JSON.",
        text={"format": {"type": "json_schema", "name": "weather", "schema": schema}},
        temperature=0,
        max_output_tokens=60,
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
