"""A Responses request checked and translated to the chat request a worker runs
(api/responses/requests.py); no Redis."""

from __future__ import annotations

import pytest

from api.errors import InvalidRequest, UnsupportedFeature
from api.responses.requests import (
    input_items,
    messages,
    parse_response_request,
    responses_error,
    translate,
)
from api.schemas import parse_request
from workers.wire.job import CHAT_COMPLETIONS

RID = "resp_abc"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": True,
}


def _translate(body: dict, context: list | None = None):
    req = parse_response_request({"model": "tiny", **body})
    return translate(req, RID, context or [])


def test_a_string_input_is_one_user_message_after_the_instructions() -> None:
    t = _translate({"input": "hi", "instructions": "Be brief.", "max_output_tokens": 7})
    assert t.chat == {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
        ],
        "max_tokens": 7,
    }
    assert t.stored["input"] == [
        {
            "id": "msg_abc_in0",
            "type": "message",
            "role": "user",
            "status": "completed",
            "content": [{"type": "input_text", "text": "hi"}],
        }
    ]
    assert t.stored["instructions"] == "Be brief." and t.stored["service_tier"] == "default"
    parse_request(CHAT_COMPLETIONS, t.chat)  # what the worker runs is a valid chat request


def test_items_become_messages_with_a_turns_text_and_calls_in_one_message() -> None:
    items = input_items(
        [
            {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
            {"type": "message", "role": "assistant", "content": "Let me look."},
            {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"role": "developer", "content": "answer in French"},
        ],
        RID,
    )
    assert [i["id"] for i in items] == [
        "msg_abc_in0",
        "msg_abc_in1",
        "fc_abc_in2",
        "fco_abc_in3",
        "msg_abc_in4",
    ]
    assert messages(items) == [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "developer", "content": "answer in French"},
    ]


def test_a_previous_conversation_comes_between_the_instructions_and_the_input() -> None:
    first = _translate({"input": "one", "instructions": "old"})
    output = [
        {
            "id": "msg_x_0",
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "two", "annotations": []}],
        }
    ]
    context = [*first.stored["input"], *output]
    second = _translate(
        {"input": "three", "instructions": "new", "previous_response_id": "resp_x"}, context
    )
    assert second.chat["messages"] == [
        {"role": "system", "content": "new"},  # the old instructions are not carried over
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "three"},
    ]
    assert second.stored["context"] == context


def test_tools_tool_choice_text_format_and_service_tier() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    t = _translate(
        {
            "input": "x",
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "parallel_tool_calls": False,
            "temperature": 0,
            "top_p": 0.5,
            "metadata": {"k": "v"},
            "service_tier": "priority",
        }
    )
    assert t.chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city",
                "parameters": WEATHER["parameters"],
                "strict": True,
            },
        }
    ]
    assert t.chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert t.chat["parallel_tool_calls"] is False and t.chat["priority"] == -1
    assert (t.chat["temperature"], t.chat["top_p"], t.chat["metadata"]) == (0, 0.5, {"k": "v"})
    assert t.stored["tools"] == [WEATHER] and t.stored["service_tier"] == "priority"
    parse_request(CHAT_COMPLETIONS, t.chat)

    fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    t = _translate({"input": "x", "text": {"format": fmt}, "service_tier": "flex"})
    assert t.chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "thing", "schema": schema, "strict": True},
    }
    assert t.stored["text"] == {"format": fmt} and t.chat["priority"] == 1
    assert t.stored["service_tier"] == "flex"
    t = _translate({"input": "x", "text": {"format": {"type": "json_object"}}})
    assert t.chat["response_format"] == {"type": "json_object"}
    assert "priority" not in _translate({"input": "x", "service_tier": "auto"}).chat


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"truncation": "auto"}, "truncation"),
        ({"max_tool_calls": 2}, "max_tool_calls"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, None),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ],
)
def test_what_llmq_does_not_do_is_refused_by_name(body: dict, param: str | None) -> None:
    with pytest.raises(UnsupportedFeature) as caught:
        _translate({"input": "x", **body})
    assert caught.value.param == (param or "input[0].content[0].type")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"background": True, "store": False}, "background"),
        ({"service_tier": "scale"}, "service_tier"),
        ({"temperature": 3}, "temperature"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"previous_response_id": "chatcmpl-1"}, "previous_response_id"),
        ({"input": []}, "input"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"bogus": 1}, "bogus"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ],
)
def test_bad_values_are_400s_naming_the_field(body: dict, param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        _translate({"input": "x", **body})
    assert caught.value.param == param


def test_chat_errors_are_worded_for_the_responses_request() -> None:
    error = responses_error(InvalidRequest("max_tokens must be less than 10.", param="max_tokens"))
    assert (error.param, error.message) == (
        "max_output_tokens",
        "max_output_tokens must be less than 10.",
    )
    error = responses_error(InvalidRequest("bad schema", param="response_format"))
    assert error.param == "text.format"
