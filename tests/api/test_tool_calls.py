"""Tool calling end to end: the official `openai` client, a real server and a real worker
process running SmolLM2 (`smollm2_*` in tests/api/conftest.py). SmolLM2's template knows
nothing of tools, so these go through the Hermes-style fallback prompt."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.api.conftest import SMOLLM2 as MODEL

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": WEATHER_PARAMS,
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 30}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
FORCED = {"type": "function", "function": {"name": "get_weather"}}
ARGS = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=60)


def test_a_forced_call_returns_arguments_that_validate(smollm2_oai) -> None:
    reply = smollm2_oai.chat.completions.create(tool_choice=FORCED, temperature=0, **ARGS)
    sampled = smollm2_oai.chat.completions.create(
        tool_choice="required", parallel_tool_calls=False, temperature=1.0, n=4, seed=5, **ARGS
    )
    assert [c.message.tool_calls[0].function.name for c in reply.choices] == ["get_weather"]
    for choice in reply.choices + sampled.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        schema = {"get_weather": WEATHER_PARAMS, "get_time": TIME["function"]["parameters"]}
        jsonschema.validate(json.loads(call.function.arguments), schema[call.function.name])
    ids = [c.message.tool_calls[0].id for c in sampled.choices]
    assert len(set(ids)) == len(ids)


def test_streamed_deltas_reassemble_into_the_result(smollm2_oai) -> None:
    reply = smollm2_oai.chat.completions.create(tool_choice=FORCED, temperature=0, **ARGS)
    stream = smollm2_oai.chat.completions.create(
        tool_choice=FORCED, temperature=0, stream=True, **ARGS
    )
    chunks = [c for c in stream if c.choices]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert content == "" and deltas[0].id.startswith("call_") and deltas[0].type == "function"
    assert [d.id for d in deltas if d.id] == [deltas[0].id]  # id and name once, first
    assert [d.function.name for d in deltas if d.function.name] == ["get_weather"]
    assert {d.index for d in deltas} == {0}
    (call,) = reply.choices[0].message.tool_calls
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert len(deltas) > 3  # the arguments came in fragments, as they were generated
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_tool_result_round_trip_renders_and_answers(smollm2_oai) -> None:
    call = {
        "id": "call_abc",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "18 degrees and sunny"},
    ]
    answer = smollm2_oai.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], max_tokens=40, temperature=0
    )
    bare = smollm2_oai.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=1, temperature=0
    )
    # the call and its result are in the prompt (JSON and the result text: ~40 tokens)
    assert answer.usage.prompt_tokens > bare.usage.prompt_tokens + 30
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    assert "<tool_call" not in (choice.message.content or "")


def test_none_never_calls_and_auto_calls_only_validly(smollm2_oai) -> None:
    none = smollm2_oai.chat.completions.create(
        tool_choice="none", temperature=1.0, n=3, seed=1, **ARGS
    )
    for choice in none.choices:
        assert choice.message.tool_calls is None and choice.finish_reason != "tool_calls"
        assert choice.message.content
    auto = smollm2_oai.chat.completions.create(
        tool_choice="auto", temperature=1.0, n=6, seed=11, **ARGS
    )
    for choice in auto.choices:
        assert "<tool_call" not in (choice.message.content or "")
        for call in choice.message.tool_calls or []:
            if choice.finish_reason == "tool_calls":  # complete calls validate
                args = json.loads(call.function.arguments)
                params = {"get_weather": WEATHER_PARAMS, "get_time": TIME["function"]["parameters"]}
                jsonschema.validate(args, params[call.function.name])
