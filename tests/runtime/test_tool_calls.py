"""Tool calling in the runtime: the parser that splits generated text into content and
calls, the grammar that keeps calls valid (checked with llguidance on SmolLM2's real
vocabulary), and the prompt (the Hermes-style fallback, and templates that render tools)."""

from __future__ import annotations

import json
from collections.abc import Iterable

import llguidance
import pytest

from runtime.chat_template import ChatTemplate
from runtime.errors import InvalidSamplingParams
from runtime.grammar_vocab import GrammarVocab
from runtime.tool_calls import (
    ToolCallParser,
    chat_for_template,
    check_tools,
    fallback_messages,
    tool_grammar,
)

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: {}
CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    "\n</tool_call>"
)


def parse(text: str, step: int | None = None) -> tuple[ToolCallParser, str, dict[int, dict]]:
    """Feed `text` in pieces of `step` characters (None: whole); the parser, the content its
    deltas carried, and each call as its deltas assemble it."""
    parser = ToolCallParser(lambda k: f"call_{k}")
    pieces = [text] if step is None else [text[i : i + step] for i in range(0, len(text), step)]
    outputs = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    calls = assemble_calls(delta for _, deltas in outputs for delta in deltas)
    return parser, "".join(content for content, _ in outputs), calls


def assemble_calls(parts: Iterable[dict]) -> dict[int, dict]:
    """Each call as its streamed parts (`tool_calls` deltas) assemble it, by index: its id
    and name, which come once, and its arguments, in pieces."""
    calls: dict[int, dict] = {}
    for part in parts:
        call = calls.setdefault(part["index"], {"id": None, "name": None, "arguments": ""})
        if "id" in part:
            assert call["id"] is None, "id and name come once"
            call["id"], call["name"] = part["id"], part["function"]["name"]
        call["arguments"] += part["function"]["arguments"]
    return calls


# ------------------------------------------------------------------ parser


@pytest.mark.parametrize("step", [None, 1, 2, 3, 7])
def test_deltas_in_any_pieces_assemble_into_the_calls_and_content(step):
    text = f"Let me look.\n{CALL}\n" + CALL.replace("celsius", "fahrenheit")
    parser, content, calls = parse(text, step)
    assert content == parser.content == "Let me look."
    assert parser.tool_calls() == [
        {
            "id": f"call_{k}",
            "type": "function",
            "function": {"name": "get_weather", "arguments": calls[k]["arguments"]},
        }
        for k in (0, 1)
    ]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert json.loads(calls[1]["arguments"])["unit"] == "fahrenheit"


@pytest.mark.parametrize("step", [1, 4])
def test_arguments_holding_braces_and_tag_like_text_come_out_whole(step):
    arguments = '{"q": "a } b </tool_call", "nested": {"x": [1, {"y": "<tool_call>"}]}}'
    text = f'<tool_call>\n{{"name": "search", "arguments": {arguments}}}\n</tool_call>'
    parser, content, calls = parse(text, step)
    assert content == "" and calls[0]["arguments"] == arguments
    assert parser.tool_calls()[0]["function"]["arguments"] == arguments


def test_text_that_may_start_a_tag_is_held_back_until_it_cannot():
    parser = ToolCallParser(lambda k: f"call_{k}")
    assert parser.feed("Use a <tool") == ("Use a", [])
    assert parser.feed("box> here") == (" <toolbox> here", [])
    assert parser.finish() == ("", [])
    assert parser.content == "Use a <toolbox> here" and parser.tool_calls() == []


def test_a_plain_answer_is_all_content():
    _, content, calls = parse("The weather is fine.  ", 3)
    assert content == "The weather is fine.  " and calls == {}


def test_a_call_cut_short_keeps_what_was_written_and_a_half_tag_is_not_content():
    parser, content, calls = parse(CALL[:-30], 5)
    assert content == "" and calls[0]["arguments"] == '{"city": "Paris", "u'
    assert parser.tool_calls()[0]["function"]["arguments"] == '{"city": "Paris", "u'
    parser, content, calls = parse(f"{CALL}\n<tool_ca", 5)
    assert content == "" and len(calls) == 1
    parser, content, calls = parse('<tool_call>\n{"na', 5)
    assert content == "" and calls == {} and parser.tool_calls() == []


FAHRENHEIT = CALL.replace("celsius", "fahrenheit")
TIME_CALL = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


def test_a_later_call_is_shown_whole_once_it_is_complete():
    parser = ToolCallParser(lambda k: f"call_{k}")
    _, first = parser.feed(CALL[:60])
    assert first and {d["index"] for d in first} == {0}  # the first call streams
    parser.feed(CALL[60:] + "\n")
    for cut in range(1, len(FAHRENHEIT)):
        _, deltas = parser.feed(FAHRENHEIT[cut - 1 : cut])
        assert deltas == [], cut  # nothing of the second call before its end
    _, deltas = parser.feed(FAHRENHEIT[-1])
    arguments = '{"city": "Paris", "unit": "fahrenheit"}'
    assert deltas == [
        {
            "index": 1,
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": arguments},
        }
    ]
    assert parser.finish() == ("", []) and parser.complete and not parser.repeated


@pytest.mark.parametrize("step", [None, 1, 5])
@pytest.mark.parametrize(
    "repeat",
    [
        CALL,
        CALL.replace('{"city": "Paris", "unit": "celsius"}', '{"unit":"celsius","city":"Paris"}'),
    ],
)
def test_a_call_repeating_an_earlier_one_is_dropped_and_ends_the_calls(step, repeat):
    text = f"{CALL}\n{FAHRENHEIT}\n{repeat}\n{TIME_CALL}\n<tool_call>\n"
    parser, content, calls = parse(text, step)
    assert parser.repeated and parser.complete and content == ""
    assert [json.loads(c["function"]["arguments"])["unit"] for c in parser.tool_calls()] == [
        "celsius",
        "fahrenheit",
    ]
    assert sorted(calls) == [0, 1]  # the repeat, and what came after it, never shown
    assert parser.feed(TIME_CALL) == ("", [])


def test_a_different_call_of_the_same_function_is_not_a_repeat():
    parser, _, calls = parse(f"{CALL}\n{FAHRENHEIT}\n{TIME_CALL}", 3)
    assert not parser.repeated and sorted(calls) == [0, 1, 2]


def test_a_later_call_cut_short_is_dropped_a_first_one_is_kept():
    parser, _, calls = parse(f"{CALL}\n{FAHRENHEIT}\n{TIME_CALL[:30]}", 4)
    assert len(parser.tool_calls()) == 2 and sorted(calls) == [0, 1] and parser.complete
    parser, _, calls = parse(CALL[:-30], 4)
    assert len(parser.tool_calls()) == 1 and not parser.complete


# ------------------------------------------------------------------ grammar


@pytest.fixture(scope="module")
def vocab(smollm2_tokenizer) -> GrammarVocab:
    return GrammarVocab(smollm2_tokenizer, smollm2_tokenizer.vocab_size)


def accepts(vocab: GrammarVocab, tokenizer, constraint, text: str) -> bool:
    matcher = llguidance.LLMatcher(vocab.lltokenizer, constraint.grammar)
    assert not matcher.is_error(), matcher.get_error()
    ids = tokenizer.encode(text, add_special=False, parse_special=False)
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


def test_auto_allows_text_and_holds_a_started_call_to_the_tools(vocab, smollm2_tokenizer):
    auto = tool_grammar([WEATHER, TIME], "auto", True)
    ok = lambda text: accepts(vocab, smollm2_tokenizer, auto, text)  # noqa: E731
    assert ok("Anything at all, {even} JSON-ish text.")
    assert ok(f"Checking.{CALL}")
    assert ok('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert not ok('<tool_call>\n{"name": "get_news", "arguments": {}}\n</tool_call>')
    assert not ok(CALL.replace('"unit": "celsius"', '"unit": "kelvin"'))
    assert not ok(CALL.replace(', "unit": "celsius"', ""))  # a required argument missing


def test_required_and_named_choices_allow_only_calls(vocab, smollm2_tokenizer):
    required = tool_grammar([WEATHER, TIME], "required", False)
    named = tool_grammar(
        [WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, True
    )
    parallel = tool_grammar([WEATHER, TIME], "required", True)
    time_call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert accepts(vocab, smollm2_tokenizer, required, CALL)
    assert not accepts(vocab, smollm2_tokenizer, required, f"Sure. {CALL}")
    assert not accepts(vocab, smollm2_tokenizer, required, f"{CALL}\n{CALL}")
    assert accepts(vocab, smollm2_tokenizer, parallel, f"{CALL}\n{time_call}")
    assert accepts(vocab, smollm2_tokenizer, named, time_call)
    assert not accepts(vocab, smollm2_tokenizer, named, CALL)
    assert not accepts(vocab, smollm2_tokenizer, named, f"{time_call}\n{time_call}")
    assert tool_grammar([WEATHER], "none", True) is None


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        ([{"type": "function"}], "auto", "tools"),
        ([{"type": "function", "function": {"name": "bad name"}}], "auto", "tools"),
        ([WEATHER, WEATHER], "auto", "tools"),
        ([WEATHER], "sometimes", "tool_choice"),
        ([WEATHER], {"type": "function", "function": {"name": "get_time"}}, "tool_choice"),
        (None, "required", "tool_choice"),
    ],
)
def test_bad_tools_and_choices_name_their_field(tools, choice, param):
    with pytest.raises(InvalidSamplingParams) as raised:
        check_tools(tools, choice, True)
    assert raised.value.param == param


# ------------------------------------------------------------------ prompt

HISTORY = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "24 C"},
]


def test_the_fallback_renders_tools_calls_and_results_in_smollm2s_chatml(smollm2_tokenizer):
    template = ChatTemplate(smollm2_tokenizer.chat_template, smollm2_tokenizer)
    assert not template.knows_tools
    messages, extra = chat_for_template(HISTORY, [WEATHER], template.knows_tools)
    text = template.render(messages, add_generation_prompt=True, **extra)
    assert text.startswith("<|im_start|>system\nYou can call functions")
    assert json.dumps(WEATHER) in text  # the tool's signature, on its own line
    assert text.endswith(
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n"
        "<tool_response>\n24 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_the_fallback_joins_an_existing_system_message_and_no_tools_adds_none():
    messages = fallback_messages([{"role": "system", "content": "Be brief."}, *HISTORY[:1]], [TIME])
    assert messages[0]["content"].startswith("Be brief.\n\nYou can call functions")
    assert len(messages) == 2
    plain = fallback_messages(HISTORY[:1], None)
    assert plain == HISTORY[:1]


def test_a_template_that_renders_tools_gets_them_and_object_arguments():
    source = (
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "{{ c.function.arguments.city }};{% endfor %}{% endfor %}"
    )
    template = ChatTemplate(source)
    assert template.knows_tools
    messages, extra = chat_for_template(HISTORY, [WEATHER, TIME], template.knows_tools)
    assert template.render(messages, **extra) == "[get_weather][get_time]Paris;Rome;"
