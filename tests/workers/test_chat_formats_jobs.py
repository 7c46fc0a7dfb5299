"""Each family's format through a worker's real path (runtime/answer_parser.py in
workers/jobs.py): a tiny model held to the format by the family's tool-call grammar or a
regex, its stream deltas and body parsed alike, the same after a resume at any token, and
the thinking tokens counted in usage."""

from __future__ import annotations

import json

import pytest

from runtime.chat_formats import (
    CALLS_BEGIN,
    DEEPSEEK_V3_1,
    HARMONY,
    LLAMA3,
    MISTRAL,
    QWEN3_XML,
    ChatFormat,
)
from runtime.chat_template import ChatTemplate
from runtime.engine import Engine
from tests.runtime.test_tool_calls import assemble_calls
from tests.workers.test_jobs import (
    CALLING,
    SHORT_TOOLS_TEMPLATE,
    THINKING,
    THINKING_TEMPLATE,
    new_job,
    resumed_alike,
    run,
)
from workers.wire.job import CHAT_COMPLETIONS
from workers.wire.responses_api import usage as responses_usage

# short templates that show the tools themselves (the tiny model's context is 256 tokens);
# a family's marker in a comment is what tells the family, as in the real templates
LLAMA3_TEMPLATE = "{# <|start_header_id|>ipython<|end_header_id|> #}" + SHORT_TOOLS_TEMPLATE
MISTRAL_TEMPLATE = "{# [TOOL_CALLS] #}" + SHORT_TOOLS_TEMPLATE
HARMONY_TEMPLATE = "{# <|channel|> #}" + SHORT_TOOLS_TEMPLATE + "<|start|>assistant"
QWEN3_XML_TEMPLATE = "{# <tool_call> <function= <parameter= #}" + SHORT_TOOLS_TEMPLATE
DEEPSEEK_TEMPLATE = "{# <｜tool▁calls▁begin｜> #}" + SHORT_TOOLS_TEMPLATE


@pytest.fixture
def engine(tiny_model) -> Engine:
    return Engine.load(str(tiny_model))


def events_of(job) -> list[dict]:
    return [json.loads(data) for _, data in job.pending]


def assembled_calls(deltas: list[dict]) -> list[dict]:
    return list(assemble_calls(p for d in deltas for p in d.get("tool_calls", [])).values())


def same_after_resumes(engine: Engine, body: dict, reference: dict, events: list[dict], cuts):
    """A job resumed after `cuts` tokens streamed gives the same body and later deltas."""
    for cut in cuts:
        job = resumed_alike(engine, body, events, cut, reference)
        assert [e["delta"] for e in events_of(job)] == [e["delta"] for e in events[cut:]]


def test_llama3_calls_are_the_whole_answer_in_json(engine):
    engine.chat_template = ChatTemplate(LLAMA3_TEMPLATE)
    assert engine.chat_template.format.family == LLAMA3
    job = new_job(CHAT_COMPLETIONS, CALLING)
    reference = run(engine, job)
    events = events_of(job)
    text = "".join(e["text"] for e in events)
    [call] = reference["choices"][0]["message"]["tool_calls"]
    assert reference["choices"][0]["finish_reason"] == "tool_calls"
    assert text == f'{{"name": "pick", "parameters": {call["function"]["arguments"]}}}'
    assert json.loads(call["function"]["arguments"])["n"] in (1, 2, 3)
    deltas = [e["delta"] for e in events]
    assert not any("content" in d for d in deltas)
    assert assembled_calls(deltas) == [
        {"id": call["id"], "name": "pick", "arguments": call["function"]["arguments"]}
    ]
    same_after_resumes(engine, CALLING, reference, events, [1, len(events) // 2, len(events) - 1])


def test_qwen3_xml_calls_typed_by_the_requests_schema(engine):
    """The worker hands the request's tools to the XML parser: `n` (an enum of integers)
    comes back as a number, not the text the model wrote."""
    engine.chat_template = ChatTemplate(QWEN3_XML_TEMPLATE)
    assert engine.chat_template.format.family == QWEN3_XML
    body = {**CALLING, "max_tokens": 240, "parallel_tool_calls": False}
    job = new_job(CHAT_COMPLETIONS, body)
    reference = run(engine, job)
    events = events_of(job)
    text = "".join(e["text"] for e in events)
    [call] = reference["choices"][0]["message"]["tool_calls"]
    assert reference["choices"][0]["finish_reason"] == "tool_calls"
    n = json.loads(call["function"]["arguments"])["n"]
    assert n in (1, 2, 3)
    head = "<tool_call>\n<function=pick>\n<parameter=n>\n"
    assert text.startswith(f"{head}{n}\n</parameter>\n</function>\n</tool_call>")
    deltas = [e["delta"] for e in events]
    assert not any("content" in d for d in deltas)
    assert assembled_calls(deltas) == [
        {"id": call["id"], "name": "pick", "arguments": call["function"]["arguments"]}
    ]
    same_after_resumes(engine, body, reference, events, [1, len(events) // 2, len(events) - 1])


def test_deepseek_v3_1_calls_after_a_control_token_marker(engine):
    engine.chat_template = ChatTemplate(DEEPSEEK_TEMPLATE)
    assert engine.chat_template.format.family == DEEPSEEK_V3_1
    marker = 1  # a control token of the tiny vocabulary, standing in for the calls' start
    engine.chat_template.format = ChatFormat(DEEPSEEK_V3_1, False, {marker: CALLS_BEGIN})
    body = {**CALLING, "max_tokens": 240, "parallel_tool_calls": False}
    job = new_job(CHAT_COMPLETIONS, body)
    reference = run(engine, job)
    events = events_of(job)
    assert events[0]["token_id"] == marker and events[0]["text"] == ""
    text = "".join(e["text"] for e in events)
    [call] = reference["choices"][0]["message"]["tool_calls"]
    arguments = call["function"]["arguments"]
    assert json.loads(arguments)["n"] in (1, 2, 3)
    head, end = "<｜tool▁call▁begin｜>pick<｜tool▁sep｜>", "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    assert text == f"{head}{arguments}{end}"
    assert reference["choices"][0]["finish_reason"] == "tool_calls"
    assert assembled_calls([e["delta"] for e in events]) == [
        {"id": call["id"], "name": "pick", "arguments": arguments}
    ]
    same_after_resumes(engine, body, reference, events, [1, len(events) // 2, len(events) - 1])


def test_mistrals_tool_calls_marker_is_a_control_token_the_parser_still_sees(engine):
    """The grammar names the marker by id, the model writes that token (no text to the
    detokenizer), and the worker gives the parser its text."""
    engine.chat_template = ChatTemplate(MISTRAL_TEMPLATE)
    marker = 1  # a control token of the tiny vocabulary, standing in for [TOOL_CALLS]
    assert engine.tokenizer.is_special(marker)
    engine.chat_template.format = ChatFormat(MISTRAL, False, {marker: "[TOOL_CALLS]"})
    job = new_job(CHAT_COMPLETIONS, CALLING)
    reference = run(engine, job)
    events = events_of(job)
    assert events[0]["token_id"] == marker and events[0]["text"] == ""
    text = "".join(e["text"] for e in events)
    [call] = reference["choices"][0]["message"]["tool_calls"]
    assert text == f'[{{"name": "pick", "arguments": {call["function"]["arguments"]}}}]'
    assert len(call["id"]) == 9 and call["id"].isalnum()  # what Mistral's templates take
    assert (
        assembled_calls([e["delta"] for e in events])[0]["arguments"]
        == (call["function"]["arguments"])
    )
    same_after_resumes(engine, CALLING, reference, events, [1, 2, len(events) - 1])


HARMONY_REGEX = (
    r"<\|channel\|>analysis<\|message\|>[a-z]{4,12}<\|end\|><\|start\|>assistant"
    r"<\|channel\|>final<\|message\|>[a-z]{2,8}"
)


def thinking_tokens(events: list[dict], end: str) -> int:
    """Tokens that start before the end of the thinking block (`end` closes it)."""
    text = "".join(e["text"] for e in events)
    stop = text.index(end) + len(end)
    count, at = 0, 0
    for e in events:
        count += at < stop
        at += len(e["text"])
    return count


def test_harmony_thinking_and_answer_and_the_thinking_tokens(engine):
    engine.chat_template = ChatTemplate(HARMONY_TEMPLATE)
    assert engine.chat_template.format.family == HARMONY
    body = {
        "messages": [{"role": "user", "content": "think"}],
        "regex": HARMONY_REGEX,
        "max_tokens": 120,
        "temperature": 0,
    }
    job = new_job(CHAT_COMPLETIONS, body)
    reference = run(engine, job)
    events = events_of(job)
    text = "".join(e["text"] for e in events)
    thinking = text.split("<|message|>")[1].split("<|end|>")[0]
    answer = text.split("<|message|>")[2]
    message = reference["choices"][0]["message"]
    assert message["reasoning_content"] == thinking and message["content"] == answer
    deltas = [e["delta"] for e in events]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == thinking
    assert "".join(d.get("content", "") for d in deltas) == answer
    usage = reference["usage"]
    assert usage["completion_tokens_details"] == {
        "reasoning_tokens": thinking_tokens(events, "<|end|>")
    }
    assert 0 < usage["completion_tokens_details"]["reasoning_tokens"] < usage["completion_tokens"]
    assert responses_usage(usage)["output_tokens_details"] == usage["completion_tokens_details"]
    same_after_resumes(engine, body, reference, events, [1, len(events) // 2, len(events) - 1])


def test_harmony_calls_under_the_grammar(engine):
    """The grammar allows thinking first; the tiny model would think until max_tokens, so
    a bias against "a" (of "analysis") sends it to the call (the grammar still writes the
    call's own "a"s: nothing else is allowed there)."""
    engine.chat_template = ChatTemplate(HARMONY_TEMPLATE)
    [letter_a] = engine.encode("a", add_special=False)
    body = {
        **CALLING,
        "tool_choice": {"type": "function", "function": {"name": "pick"}},
        "logit_bias": {str(letter_a): -100},
    }
    job = new_job(CHAT_COMPLETIONS, body)
    reference = run(engine, job)
    events = events_of(job)
    text = "".join(e["text"] for e in events)
    [call] = reference["choices"][0]["message"]["tool_calls"]
    head = "<|channel|>commentary to=functions.pick <|constrain|>json<|message|>"
    assert text.endswith(head + call["function"]["arguments"])
    assert reference["choices"][0]["finish_reason"] == "tool_calls"
    assert assembled_calls([e["delta"] for e in events]) == [
        {"id": call["id"], "name": "pick", "arguments": call["function"]["arguments"]}
    ]
    same_after_resumes(engine, body, reference, events, [1, len(events) - 1])


def test_a_think_blocks_tokens_are_counted(engine):
    engine.chat_template = ChatTemplate(THINKING_TEMPLATE)
    body = THINKING
    job = new_job(CHAT_COMPLETIONS, body)
    reference = run(engine, job)
    assert reference["usage"]["completion_tokens_details"] == {
        "reasoning_tokens": thinking_tokens(events_of(job), "</think>")
    }
    plain = run(engine, new_job(CHAT_COMPLETIONS, {**body, "regex": "[a-z]{2,8}"}))
    assert plain["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


def test_text_a_stop_string_held_back_reaches_the_parser_before_the_next_marker(engine):
    """<|message|> is a control token here; the stop string "on!" holds back the "on" of
    "json" until the marker comes, and the parser still reads "json<|message|>{...}" in
    that order (were the held text released after the marker, the arguments would start
    with "on")."""
    engine.chat_template = ChatTemplate(HARMONY_TEMPLATE)
    marker = 1  # a control token of the tiny vocabulary, standing in for <|message|>
    engine.chat_template.format = ChatFormat(HARMONY, False, {marker: "<|message|>"})
    [letter_a] = engine.encode("a", add_special=False)
    body = {
        **CALLING,
        "tool_choice": {"type": "function", "function": {"name": "pick"}},
        "logit_bias": {str(letter_a): -100},
        "stop": ["on!"],
    }
    job = new_job(CHAT_COMPLETIONS, body)
    reference = run(engine, job)
    events = events_of(job)
    at_marker = next(i for i, e in enumerate(events) if e["token_id"] == marker)
    text = "".join(e["text"] for e in events)
    assert "".join(e["text"] for e in events[: at_marker + 1]).endswith("<|constrain|>json")
    [call] = reference["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"])["n"] in (1, 2, 3)
    assert text.endswith("<|constrain|>json" + call["function"]["arguments"])
    assert assembled_calls([e["delta"] for e in events]) == [
        {"id": call["id"], "name": "pick", "arguments": call["function"]["arguments"]}
    ]
    same_after_resumes(engine, body, reference, events, [at_marker, at_marker + 1])
