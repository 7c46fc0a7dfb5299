"""DeepSeek R1 / V3.1 tool calls (runtime/deepseek_calls.py): calls rendered by the real
templates (R1's distills, llama.cpp's R1 template, V3.1) parse back to the OpenAI calls they
were rendered from, however the text is cut; the prompt shows the tools where the template
does not; the grammar takes those answers and refuses invalid calls, with the markers as
control tokens of the vocabulary or as text."""

from __future__ import annotations

import json

import llguidance
import pytest

from runtime.chat_formats import DEEPSEEK_MARKERS, DEEPSEEK_R1, DEEPSEEK_V3_1
from runtime.chat_template import ChatTemplate
from runtime.grammar_vocab import GrammarVocab
from runtime.tokenizer import Tokenizer
from runtime.tool_calls import chat_for_template, tool_grammar
from tests.runtime.test_chat_formats import (
    ARGUMENTS,
    CALL,
    TEMPLATES,
    WEATHER,
    every_cut,
    needs_templates,
    template,
)

R1_TEMPLATES = [
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B",
    "llama-cpp-deepseek-r1",
]
TEMPLATES_OF = {name: DEEPSEEK_R1 for name in R1_TEMPLATES} | {
    "deepseek-ai-DeepSeek-V3.1": DEEPSEEK_V3_1
}
SECOND = {**CALL, "id": "xyz987abc", "function": {"name": "get_time", "arguments": "{}"}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
ASSISTANT, END = "<｜Assistant｜>", "<｜end▁of▁sentence｜>"


def rendered_calls(name: str, calls: list[dict]) -> str:
    """What the template writes for an assistant turn of `calls`: the answer after the
    assistant's marker (and V3.1's empty thinking), without the turn's end."""
    chat = template(name)
    turns = [{"role": "user", "content": "Weather in Paris?"}]
    turn = {"role": "assistant", "content": None, "tool_calls": calls}
    base, full = (_prompt(chat, t) for t in (turns, [*turns, turn]))
    assert full.startswith(base)
    answer = full[len(base) :].removeprefix(ASSISTANT).removeprefix("<think></think>")
    return answer.removesuffix(END)


def _prompt(chat: ChatTemplate, turns: list[dict]) -> str:
    messages, extra = chat_for_template(turns, [WEATHER, TIME], chat.knows_tools, chat.format)
    return chat.render(messages, add_generation_prompt=False, **extra)


@needs_templates
@pytest.mark.parametrize("name", sorted(TEMPLATES_OF))
def test_calls_the_template_renders_parse_back_however_they_are_cut(name):
    fmt = template(name).format
    assert fmt.family == TEMPLATES_OF[name]
    text = rendered_calls(name, [CALL, SECOND])
    assert text.startswith("<｜tool▁calls▁begin｜>")
    _, content, calls, parser = every_cut(fmt, text)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", ARGUMENTS),
        ("get_time", {}),
    ]
    assert [c["function"]["arguments"] for c in parser.tool_calls()] == [
        c["arguments"] for c in calls
    ]
    assert content == "" and parser.complete


@needs_templates
def test_r1_thinks_then_calls_and_text_around_calls():
    fmt = template("llama-cpp-deepseek-r1").format
    calls_text = rendered_calls("llama-cpp-deepseek-r1", [CALL])
    text = "Need the weather.\n</think>\n\nLet me check. " + calls_text
    reasoning, content, calls, _ = every_cut(fmt, text, thinking=True)
    assert reasoning.strip() == "Need the weather." and content == "Let me check."
    assert json.loads(calls[0]["arguments"]) == ARGUMENTS
    # the list cut short: the call so far, not complete; a marker's start is no content
    _, content, calls, parser = every_cut(fmt, calls_text[:-40])
    assert calls[0]["name"] == "get_weather" and not parser.complete and content == ""
    _, content, calls, _ = every_cut(fmt, "No calls <｜tool here.")
    assert content == "No calls <｜tool here." and calls == []


@needs_templates
@pytest.mark.parametrize(
    "name", ["deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "deepseek-ai-DeepSeek-V3.1"]
)
def test_the_prompt_shows_the_tools_and_the_models_own_past_calls_and_results(name):
    """Their templates do not render `tools`: the tools and the call syntax join the system
    message, and the template writes past calls and results in its own markers."""
    chat = template(name)
    assert not chat.knows_tools
    turns = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": CALL["id"], "content": "sunny"},
    ]
    messages, extra = chat_for_template(turns, [WEATHER], chat.knows_tools, chat.format)
    prompt = chat.render(messages, add_generation_prompt=True, **extra)
    assert prompt.count('"name": "get_weather"') == 1  # the tool's description
    assert "Be brief.\n\nYou can call any of the following function tools" in prompt
    assert "<tool_call>" not in prompt
    head = "function<｜tool▁sep｜>get_weather\n```json\n" if "R1" in name else "get_weather"
    assert f"<｜tool▁call▁begin｜>{head}" in prompt
    assert json.dumps(ARGUMENTS) in prompt
    assert "<｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜>" in prompt


@needs_templates
def test_the_r1_llama_distill_takes_the_arguments_as_a_string():
    """Its template adds the arguments to its text: given OpenAI's string, not the object."""
    chat = template("deepseek-ai-DeepSeek-R1-Distill-Llama-8B")
    assert chat.format.string_arguments
    assert not template("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B").format.string_arguments
    text = rendered_calls("deepseek-ai-DeepSeek-R1-Distill-Llama-8B", [CALL, SECOND])
    assert f"```json\n{CALL['function']['arguments']}\n```" in text


# ------------------------------------------------------------------ grammars


@pytest.fixture(scope="module")
def vocabs(smollm2_metadata, smollm2_tokenizer) -> dict[str, Tokenizer]:
    """SmolLM2's vocabulary with DeepSeek's markers as control tokens ("tokens"), or as is
    ("text": the markers spelled in text)."""
    meta = dict(smollm2_metadata)
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], *DEEPSEEK_MARKERS]
    types = [*meta["tokenizer.ggml.token_type"], *[3] * len(DEEPSEEK_MARKERS)]
    meta["tokenizer.ggml.token_type"] = types
    return {"tokens": Tokenizer.from_metadata(meta), "text": smollm2_tokenizer}


@needs_templates
@pytest.mark.parametrize("kind", ["tokens", "text"])
@pytest.mark.parametrize("name", ["llama-cpp-deepseek-r1", "deepseek-ai-DeepSeek-V3.1"])
def test_the_grammar_takes_the_templates_calls_and_nothing_else(name, kind, vocabs):
    tokenizer = vocabs[kind]
    vocab = GrammarVocab(tokenizer, tokenizer.vocab_size)
    fmt = ChatTemplate((TEMPLATES / f"{name}.jinja").read_text(), tokenizer).format
    assert bool(fmt.marker_ids) == (kind == "tokens")

    def accepts(choice, text: str, parallel: bool = True, thinking: bool = False) -> bool:
        grammar = tool_grammar([WEATHER, TIME], choice, parallel, fmt, thinking).grammar
        matcher = llguidance.LLMatcher(vocab.lltokenizer, grammar)
        assert not matcher.is_error(), matcher.get_error()
        ids = tokenizer.encode(text, add_special=False, parse_special=True)
        return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()

    one, two = rendered_calls(name, [CALL]), rendered_calls(name, [CALL, SECOND])
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("auto", "required", named):
        assert accepts(choice, one), choice
        assert not accepts(choice, one.replace('"days": 3', '"days": "3"')), choice
        assert not accepts(choice, one.replace("get_weather", "get_rain")), choice
    assert accepts("required", two) and accepts("auto", two)
    assert not accepts("required", two, parallel=False) and not accepts(named, two)
    assert accepts("auto", "It is sunny.") and not accepts("required", "It is sunny.")
    assert accepts("auto", "Let me see. " + one)
    # R1's prompt opens <think>: a forced call may only follow the block
    thought = "Need the weather.\n</think>\n\n"
    assert accepts("required", thought + one, thinking=True)
    assert not accepts("required", thought + "It is sunny.", thinking=True)
