"""`GenerationSpec`: the one reader of a request body, and the errors that name their field."""

from __future__ import annotations

import json

import pytest

from runtime.constraints import Constraint
from runtime.errors import EmptyPromptError, InvalidSamplingParams, LLMQRuntimeError
from runtime.limits import DEFAULT_COMPLETION_TOKENS, MAX_CHOICES
from runtime.request import GenerationSpec


def test_a_completions_body_becomes_a_spec():
    spec = GenerationSpec.from_body(
        {"prompt": "hi", "n": 2, "temperature": 0, "stop": ["x"], "seed": 7, "logprobs": 1},
        chat=False,
    )
    assert spec.prompts == ["hi"] and spec.messages is None and not spec.chat
    assert spec.max_tokens == DEFAULT_COMPLETION_TOKENS
    a, b = spec.choice_params(5)
    assert (a.seed, b.seed) == (7, 8)  # reproducible, and different per choice
    assert a.stop == ["x"] and a.temperature == 0 and a.logprobs == 1 and a.max_tokens == 5


def test_a_chat_body_becomes_a_spec():
    messages = [{"role": "user", "content": "hi"}]
    body = {"messages": messages, "max_completion_tokens": 9, "max_tokens": 3}
    spec = GenerationSpec.from_body({**body, "logprobs": True, "top_logprobs": 2}, chat=True)
    assert spec.chat and spec.messages == messages
    assert spec.max_tokens == 9 and spec.logprobs == 2
    assert GenerationSpec.from_body({"messages": messages}, chat=True).max_tokens is None


def test_cache_prompt_defaults_to_true():
    assert GenerationSpec.from_body({"prompt": "x"}, chat=False).cache_prompt
    assert not GenerationSpec.from_body(
        {"prompt": "x", "cache_prompt": False}, chat=False
    ).cache_prompt


@pytest.mark.parametrize(
    ("body", "chat", "param"),
    [
        ({"prompt": "x", "n": 0}, False, "n"),
        ({"prompt": []}, False, "prompt"),
        ({"messages": []}, True, "messages"),
        ({"prompt": ["x"] * MAX_CHOICES, "n": 2}, False, "n"),
    ],
)
def test_errors_name_the_field(body, chat, param):
    with pytest.raises(LLMQRuntimeError) as raised:
        GenerationSpec.from_body(body, chat=chat)
    assert raised.value.param == param


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -1), ("top_p", 1.5), ("top_k", -5), ("presence_penalty", 3)],
)
def test_sampling_errors_name_the_field(field, value):
    spec = GenerationSpec.from_body({"prompt": "x", field: value}, chat=False)
    with pytest.raises(InvalidSamplingParams) as raised:
        spec.choice_params(4)
    assert raised.value.param == field


def test_a_stop_string_error_names_stop_and_logit_bias_names_logit_bias():
    with pytest.raises(InvalidSamplingParams) as raised:
        GenerationSpec.from_body({"prompt": "x", "stop": [""]}, chat=False).choice_params(1)
    assert raised.value.param == "stop"
    with pytest.raises(InvalidSamplingParams) as raised:
        GenerationSpec.from_body(
            {"prompt": "x", "logit_bias": {"1": 500}}, chat=False
        ).choice_params(1)
    assert raised.value.param == "logit_bias"


def test_empty_prompt_errors_default_to_the_prompt_field():
    assert EmptyPromptError("empty").param == "prompt"
    assert EmptyPromptError("empty", param="input").param == "input"


def test_a_spec_survives_the_job_record():
    spec = GenerationSpec.from_body(
        {"prompt": [[5, 6], "hi"], "n": 2, "top_k": 3, "stop": ["\n"], "logprobs": 2},
        chat=False,
    )
    back = GenerationSpec.from_record(json.loads(json.dumps(spec.to_record())))
    assert back == spec
    assert back.choice_params(4) == spec.choice_params(4)


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"colour": "red"}, "colour"),
        ({"n": 0}, "n"),
        ({"stop": "x"}, "stop"),
        ({"prompts": None}, "prompt"),  # neither prompts nor messages
        ({"messages": [{"role": "user", "content": "x"}]}, "prompt"),  # both
    ],
)
def test_a_record_from_redis_is_checked_like_a_body(change, param):
    record = {**GenerationSpec.from_body({"prompt": "x"}, chat=False).to_record(), **change}
    with pytest.raises(LLMQRuntimeError) as raised:
        GenerationSpec.from_record(record)
    assert raised.value.param == param


def test_a_constraint_goes_to_every_choice_and_survives_the_record():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "n": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    }
    spec = GenerationSpec.from_body(body, chat=True)
    assert spec.constraint == Constraint("json_schema", schema, "response_format")
    back = GenerationSpec.from_record(json.loads(json.dumps(spec.to_record())))
    assert back == spec
    assert [p.constraint for p in back.choice_params(4)] == [spec.constraint] * 2
    regex = GenerationSpec.from_body({"prompt": "x", "regex": "[0-9]+"}, chat=False)
    assert regex.constraint == Constraint("regex", "[0-9]+", "regex")
    assert GenerationSpec.from_body({"prompt": "x"}, chat=False).constraint is None


@pytest.mark.parametrize(
    "constraint",
    [
        "json_object",  # not an object
        {"kind": "xml", "value": None, "param": None},
        {"kind": "regex", "value": 5, "param": "regex"},
        {"kind": "json_object", "value": None, "param": None, "extra": 1},
        {"kind": "json_object", "value": None, "param": 7},
    ],
)
def test_a_constraint_from_redis_is_checked_again(constraint):
    record = {**GenerationSpec.from_body({"prompt": "x"}, chat=False).to_record()}
    record["constraint"] = constraint
    with pytest.raises(LLMQRuntimeError) as raised:
        GenerationSpec.from_record(record)
    assert raised.value.param in ("response_format", "regex")
