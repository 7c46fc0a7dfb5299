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


# The case users hit: "required" with two tools at temperature 0. SmolLM2 writes a complete
# call, then, allowed more (`parallel_tool_calls`, OpenAI's default), more calls until
# max_tokens. The answer keeps the complete calls and ends "tool_calls" (runtime/tool_calls.py
# `ToolCallParser`, workers/jobs.py `_settle`).
REQUIRED = dict(ARGS, tool_choice="required", temperature=0, max_tokens=80)
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME["function"]["parameters"]}


def _call_key(call) -> tuple[str, object]:
    return call.function.name, json.loads(call.function.arguments)


def test_required_ends_with_complete_calls_not_a_cut_off_one(smollm2_oai) -> None:
    parallel = smollm2_oai.chat.completions.create(**REQUIRED)
    single = smollm2_oai.chat.completions.create(**REQUIRED, parallel_tool_calls=False)
    choice = parallel.choices[0]
    # it ran to max_tokens (a call was cut there), and the answer still ends with its calls
    assert parallel.usage.completion_tokens == REQUIRED["max_tokens"]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    keys = [_call_key(c) for c in choice.message.tool_calls]
    assert len(keys) == len({json.dumps(k, sort_keys=True) for k in keys})  # no call twice
    # parallel_tool_calls false: one call, and the grammar ends the answer there
    (call,) = single.choices[0].message.tool_calls
    assert single.choices[0].finish_reason == "tool_calls"
    assert single.usage.completion_tokens < REQUIRED["max_tokens"]
    assert _call_key(call) == keys[0]  # the same first call: greedy, same prompt


def test_a_repeated_call_ends_the_answer_early(smollm2_oai, smollm2_tokenizer) -> None:
    ask = [
        {"role": "user", "content": "What time is it in Tokyo and what is the weather in Paris?"}
    ]
    reply = smollm2_oai.chat.completions.create(**{**REQUIRED, "max_tokens": 300, "messages": ask})
    choice = reply.choices[0]
    (call,) = choice.message.tool_calls  # then it wrote the same call again: dropped
    assert choice.finish_reason == "tool_calls"
    # the answer stopped at the end of the repeat (unchecked, SmolLM2 repeats it to max_tokens)
    block = f'<tool_call>\n{{"name": "{call.function.name}", "arguments": '
    block += f"{call.function.arguments}}}\n</tool_call>"
    written = smollm2_tokenizer.encode(f"{block}\n{block}", add_special=False)
    assert reply.usage.completion_tokens == len(written) < 300


def test_streamed_parallel_calls_reassemble_into_the_result(smollm2_oai) -> None:
    reply = smollm2_oai.chat.completions.create(**REQUIRED)
    stream = smollm2_oai.chat.completions.create(**REQUIRED, stream=True)
    chunks = [c for c in stream if c.choices]
    calls: dict[int, dict[str, str]] = {}
    later_deltas = 0
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += delta.id or ""
            call["name"] += (delta.function.name or "") if delta.function else ""
            call["arguments"] += (delta.function.arguments or "") if delta.function else ""
            later_deltas += delta.index > 0
    expected = [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in reply.choices[0].message.tool_calls
    ]
    assert [{k: calls[i][k] for k in ("name", "arguments")} for i in sorted(calls)] == expected
    ids = [calls[i]["id"] for i in sorted(calls)]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == len(ids)
    assert later_deltas == len(expected) - 1  # a later call comes whole, in one delta
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
