"""Qwen3-Coder's XML tool calls (runtime/xml_calls.py): calls rendered by the real templates
of Qwen3-Coder, Qwen3.5, Nemotron Nano 3 and StepFun 3.5 parse back to the OpenAI calls they
were rendered from, however the text is cut; values typed by the tool's schema; the grammar
takes those answers and refuses invalid calls."""

from __future__ import annotations

import json

import llguidance
import pytest

from runtime.chat_formats import QWEN3_XML, ChatFormat
from runtime.grammar_vocab import GrammarVocab
from runtime.reasoning import opens_inside, thinks
from runtime.tool_calls import chat_for_template, tool_grammar
from runtime.xml_calls import XmlCallParser, schema_types, typed_value
from tests.runtime.test_chat_formats import (
    every_cut,
    needs_templates,
    rendered_answer,
    template,
)

XML_TEMPLATES = [
    "Qwen3-Coder",
    "Qwen3.5-4B",
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
    "StepFun3.5-Flash",
]
PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "metric": {"type": "boolean"},
        "options": {"type": "object"},
        "note": {"type": ["string", "null"]},
    },
    "required": ["city", "days"],
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TOOLS = [WEATHER, TIME]
ARGUMENTS = {
    "city": "Paris {x}\nrue </p> 7",
    "days": 3,
    "metric": True,
    "options": {"units": ["C", "mm"]},
    "note": "007",
}


def call(name: str, arguments: dict, call_id: str = "abc123def") -> dict:
    function = {"name": name, "arguments": json.dumps(arguments)}
    return {"id": call_id, "type": "function", "function": function}


def thinking_of(name: str) -> bool | None:
    """What the worker gives the parser: None where the model does not think, else whether
    its prompt leaves the answer inside `<think>`."""
    chat = template(name)
    if not thinks(chat.source):
        return None
    prompt = chat.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    return opens_inside(prompt)


@needs_templates
@pytest.mark.parametrize("name", XML_TEMPLATES)
def test_calls_the_template_renders_parse_back_however_they_are_cut(name):
    fmt = template(name).format
    assert fmt.family == QWEN3_XML
    calls = [call("get_weather", ARGUMENTS), call("get_time", {}, "xyz987abc")]
    message = {"role": "assistant", "content": "", "tool_calls": calls}
    thinking = thinking_of(name)
    if thinking:
        message["reasoning_content"] = "Need the weather."
    text = rendered_answer(name, message, TOOLS)
    reasoning, content, got, parser = every_cut(fmt, text, thinking=thinking, tools=TOOLS)
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == [
        ("get_weather", ARGUMENTS),
        ("get_time", {}),
    ]
    assert [c["function"]["arguments"] for c in parser.tool_calls()] == [
        c["arguments"] for c in got
    ]
    assert content == "" and parser.complete
    if thinking:  # the block's own newline before </think> stays, as for Hermes's Qwen3
        assert reasoning.rstrip("\n") == "Need the weather."


@needs_templates
def test_content_before_the_call_and_a_plain_answer():
    fmt = template("Qwen3.5-4B").format
    message = {
        "role": "assistant",
        "content": "Let me check.",
        "reasoning_content": "Hm.",
        "tool_calls": [call("get_weather", {"city": "Rome", "days": 1})],
    }
    text = rendered_answer("Qwen3.5-4B", message, TOOLS)
    assert "Let me check.\n\n<tool_call>" in text
    reasoning, content, got, _ = every_cut(fmt, text, thinking=True, tools=TOOLS)
    assert content == "Let me check." and reasoning.strip() == "Hm."
    assert json.loads(got[0]["arguments"]) == {"city": "Rome", "days": 1}
    _, content, got, _ = every_cut(fmt, "Use <tool_ or <function=x> freely.", tools=TOOLS)
    assert content == "Use <tool_ or <function=x> freely." and got == []


@needs_templates
def test_past_calls_and_tool_results_render_through_the_models_template():
    chat = template("Qwen3.5-4B")
    turns = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call("get_weather", ARGUMENTS)]},
        {"role": "tool", "tool_call_id": "abc123def", "content": "sunny"},
    ]
    messages, extra = chat_for_template(turns, TOOLS, chat.knows_tools)
    prompt = chat.render(messages, add_generation_prompt=True, **extra)
    assert "<function=get_weather>\n<parameter=city>\nParis {x}\nrue </p> 7\n</parameter>" in prompt
    assert '<parameter=options>\n{"units": ["C", "mm"]}\n</parameter>' in prompt
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in prompt


def test_a_string_value_streams_before_it_ends():
    parser = XmlCallParser(lambda k: f"call_{k}", TOOLS)
    _, deltas = parser.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar")
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"city": "Par'
    _, deltas = parser.feed("is\n</param")  # the newline may be the value's end: held
    assert "".join(d["function"]["arguments"] for d in deltas) == "is"
    _, deltas = parser.feed("eter>\n<parameter=days>\n4")
    assert "".join(d["function"]["arguments"] for d in deltas) == '", "days": '
    assert not parser.complete  # cut short: the call is not complete
    parser.feed("\n</parameter>\n</function>\n</tool_call>")
    assert parser.tool_calls()[0]["function"]["arguments"] == '{"city": "Paris", "days": 4}'
    assert parser.complete


def test_values_are_typed_by_the_schema():
    def value(text, schema):
        return json.loads(typed_value(text, schema_types(schema)))

    assert value("007", {"type": "string"}) == "007"
    assert value("3", {"type": "integer"}) == 3
    assert value("2.5", {"type": "number"}) == 2.5
    assert value("True", {"type": "boolean"}) is True
    assert value("false", {"type": "boolean"}) is False
    assert value('{"a": [1]}', {"type": "object"}) == {"a": [1]}
    assert value("[1, 2]", {"type": "array"}) == [1, 2]
    assert value("3", {"type": ["string", "number"]}) == 3
    assert value("three", {"type": ["string", "number"]}) == "three"
    assert value("null", {"anyOf": [{"type": "string"}, {"type": "null"}]}) is None
    assert value("[1]", {"type": ["string", "null"]}) == "[1]"  # not a type it allows
    assert value("2", {"enum": [1, 2]}) == 2
    assert value('{"a": 1}', {}) == {"a": 1}  # no type: JSON where it parses
    assert value("hello", {}) == "hello"


def test_a_call_to_no_function_is_dropped():
    parser = XmlCallParser(lambda k: f"call_{k}", TOOLS)
    parser.feed('<tool_call>\n{"name": "x"}\n</tool_call>\nDone.')
    parser.finish()
    assert parser.tool_calls() == [] and parser.content == "Done."


# ------------------------------------------------------------------ grammar


@pytest.fixture(scope="module")
def accepts(smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    vocab = GrammarVocab(tokenizer, tokenizer.vocab_size)

    def accepts(constraint, text: str) -> bool:
        matcher = llguidance.LLMatcher(vocab.lltokenizer, constraint.grammar)
        assert not matcher.is_error(), matcher.get_error()
        ids = tokenizer.encode(text, add_special=False, parse_special=True)
        return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()

    return accepts


@needs_templates
@pytest.mark.parametrize("name", XML_TEMPLATES)
def test_the_grammar_takes_what_each_template_renders(name, accepts):
    fmt = template(name).format
    calls = [call("get_weather", ARGUMENTS), call("get_time", {}, "xyz987abc")]
    message = {"role": "assistant", "content": "", "tool_calls": calls}
    if thinking_of(name):
        message["reasoning_content"] = "Need the weather."
    text = rendered_answer(name, message, TOOLS)
    calls_only = text[text.index("<tool_call>") :]
    assert accepts(tool_grammar(TOOLS, "auto", True, fmt), text)
    assert accepts(tool_grammar(TOOLS, "required", True, fmt), calls_only)
    assert not accepts(tool_grammar(TOOLS, "required", False, fmt), calls_only)  # two calls
    if thinking_of(name):  # the prompt opens <think>: a forced call comes after the block
        required = tool_grammar(TOOLS, "required", True, fmt, thinking=True)
        assert text != calls_only and accepts(required, text)
        assert not accepts(tool_grammar(TOOLS, "required", True, fmt), text)
        assert not accepts(required, "Need the weather.\n</think>\n\nIt is sunny.")
        assert not accepts(required, calls_only)  # the block is not closed


@needs_templates
def test_the_grammar_refuses_invalid_calls(accepts):
    fmt = template("Qwen3-Coder").format
    text = rendered_answer(
        "Qwen3-Coder",
        {"role": "assistant", "content": "", "tool_calls": [call("get_weather", ARGUMENTS)]},
        TOOLS,
    )
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("auto", "required", named):
        grammar = tool_grammar(TOOLS, choice, True, fmt)
        assert accepts(grammar, text), choice
        assert not accepts(grammar, text.replace("\n3\n", "\nthree\n")), choice  # integer
        assert not accepts(grammar, text.replace("\nTrue\n", '\n"yes"\n')), choice
        assert not accepts(grammar, text.replace("get_weather", "get_rain")), choice
        assert not accepts(grammar, text.replace("<parameter=city>", "<parameter=town>")), choice
    # the required parameters in another order, optional ones left out
    swapped = (
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n"
        "<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
    )
    assert accepts(tool_grammar(TOOLS, "required", True, fmt), swapped)
    missing = swapped.replace("<parameter=days>\n2\n</parameter>\n", "")
    assert not accepts(tool_grammar(TOOLS, "required", True, fmt), missing)
    assert accepts(tool_grammar(TOOLS, "auto", True, fmt), "It is sunny.")
    assert not accepts(tool_grammar(TOOLS, "required", True, fmt), "It is sunny.")
    assert not accepts(tool_grammar(TOOLS, named, True, fmt), text.replace("weather", "time"))


def test_the_grammar_takes_required_parameters_in_any_order_each_once(accepts):
    fmt = ChatFormat(QWEN3_XML)  # no template needed
    params = {"properties": {"x": {"type": "integer"}, "y": {"type": "string"}}}
    move = {"type": "function", "function": {"name": "move", "parameters": params}}
    move["function"]["parameters"]["required"] = ["x", "y"]
    x, y = "<parameter=x>\n1\n</parameter>\n", "<parameter=y>\nup\n</parameter>\n"
    grammar = tool_grammar([move], "required", False, fmt)

    def text(*parts: str) -> str:
        return "<tool_call>\n<function=move>\n" + "".join(parts) + "</function>\n</tool_call>"

    assert accepts(grammar, text(x, y)) and accepts(grammar, text(y, x))
    assert not accepts(grammar, text(x)) and not accepts(grammar, text(x, y, x))
