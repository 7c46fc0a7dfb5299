"""A Responses request checked and translated to the chat request a worker runs
(api/responses/requests.py); no Redis."""

from __future__ import annotations

import pytest

from api.errors import InvalidRequest, UnsupportedFeature
from api.flow import check_context
from api.responses.requests import messages, parse_response_request, translate
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


class _Dicts:
    """A translation as JSON: the chat request as its fields were set, the stored request
    as the record keeps it."""

    def __init__(self, translation) -> None:
        self.typed = translation.chat
        self.chat = translation.chat.model_dump(exclude_unset=True)
        self.stored = translation.stored.encode()


def _translate(body: dict, context: list | None = None) -> _Dicts:
    req = parse_response_request({"model": "tiny", **body})
    return _Dicts(translate(req, RID, context or []))


def input_items(value: list, response_id: str) -> list:
    return parse_response_request({"model": "tiny", "input": value}).input_items(response_id)


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
    # what the worker runs is a valid chat request, the same as parsed from its JSON
    assert parse_request(CHAT_COMPLETIONS, t.chat).to_job_request() == t.typed.to_job_request()


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
    assert parse_request(CHAT_COMPLETIONS, t.chat).to_job_request() == t.typed.to_job_request()

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
    chat = _translate({"input": "x", "max_output_tokens": 10}).typed
    with pytest.raises(InvalidRequest) as caught:
        check_context(chat, chat.to_spec(), {"context_length": 10})
    assert (caught.value.param, caught.value.message) == (
        "max_output_tokens",
        "max_output_tokens must be less than the model's context length (10 tokens), got 10.",
    )
    bad = {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}
    with pytest.raises(InvalidRequest) as caught:
        _translate({"input": "x", "text": {"format": bad}})
    assert caught.value.param == "text.format"
