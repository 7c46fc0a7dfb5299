"""Tool calls and thinking in each family's own format (runtime/chat_formats.py,
runtime/json_calls.py, runtime/harmony.py): the family told from llama.cpp's real templates,
the parsers on answers those templates render (an assistant turn with calls rendered and
parsed back, fed whole and cut at every character), and the grammars accepting exactly those
answers, with the markers as control tokens of the vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
import pytest

from runtime.answer_parser import answer_parser, reasoning_tokens
from runtime.chat_formats import (
    DEEPSEEK_R1,
    DEEPSEEK_V3_1,
    HARMONY,
    HERMES,
    LLAMA3,
    MISTRAL,
    QWEN3_XML,
    ChatFormat,
    detect_family,
)
from runtime.chat_template import ChatTemplate
from runtime.grammar_vocab import GrammarVocab
from runtime.tokenizer import Tokenizer
from runtime.tool_calls import _native_message, tool_grammar
from tests.runtime.test_tool_calls import assemble_calls

TEMPLATES = (
    Path(__file__).parents[2]
    / "build/llama-cpp-python-src/llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates"
)
needs_templates = pytest.mark.skipif(
    not TEMPLATES.is_dir(), reason="`make test` unpacks llama.cpp's templates"
)
PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather.", "parameters": PARAMS},
}
ARGUMENTS = {"city": "Paris {x}", "days": 3}
CALL = {
    "id": "abc123def",
    "type": "function",
    "function": {"name": "get_weather", "arguments": json.dumps(ARGUMENTS)},
}
FAMILIES = {
    "meta-llama-Llama-3.1-8B-Instruct": (LLAMA3, False),
    "meta-llama-Llama-3.2-3B-Instruct": (LLAMA3, False),
    "meta-llama-Llama-3.3-70B-Instruct": (LLAMA3, False),
    "mistralai-Mistral-Nemo-Instruct-2407": (MISTRAL, False),
    "Mistral-Small-3.2-24B-Instruct-2506": (MISTRAL, True),
    "unsloth-mistral-Devstral-Small-2507": (MISTRAL, True),
    "mistralai-Ministral-3-14B-Reasoning-2512": (MISTRAL, True),
    "openai-gpt-oss-120b": (HARMONY, False),
    "Qwen-Qwen2.5-7B-Instruct": (HERMES, False),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": (HERMES, False),
    "Qwen-Qwen3-0.6B": (HERMES, False),
    "meetkai-functionary-medium-v3.1": (HERMES, False),  # ipython role, its own calls
    "Qwen3-Coder": (QWEN3_XML, False),
    "Qwen3.5-4B": (QWEN3_XML, False),
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": (QWEN3_XML, False),
    "StepFun3.5-Flash": (QWEN3_XML, False),
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": (DEEPSEEK_R1, False),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": (DEEPSEEK_R1, False),
    "llama-cpp-deepseek-r1": (DEEPSEEK_R1, False),
    "deepseek-ai-DeepSeek-V3.1": (DEEPSEEK_V3_1, False),
    "deepseek-ai-DeepSeek-V3.2": (HERMES, False),  # DSML calls, not parsed yet
}
# every template of the folder not named here is Hermes's (what `detect_family` gave each
# before the XML and DeepSeek families; a template changing family fails the test below)
NOT_HERMES = {name for name, (family, _) in FAMILIES.items() if family != HERMES}
# what ends a turn in each template (a stop token: never text the parser sees)
TURN_ENDS = ("<|eot_id|>", "<|eom_id|>", "</s>", "<|im_end|>\n", "<|im_end|>")


def template(name: str) -> ChatTemplate:
    return ChatTemplate(
        (TEMPLATES / f"{name}.jinja").read_text(), bos_token="<s>", eos_token="</s>"
    )


def rendered_answer(name: str, message: dict, tools: list | None = None) -> str:
    """What the template writes for `message` after the generation prompt: the answer a
    model trained on it gives (without the turn's end token)."""
    chat = template(name)
    tools = tools or [WEATHER]
    turns = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = chat.render(turns, add_generation_prompt=True, tools=tools)
    full = chat.render(turns + [_native_message(message)], add_generation_prompt=False, tools=tools)
    assert full.startswith(prompt), "the answer continues the generation prompt"
    answer = full[len(prompt) :]
    for end in TURN_ENDS:
        answer = answer.removesuffix(end)
    return answer


def parse(
    fmt: ChatFormat, text: str, cuts: list[int], calls: bool = True, thinking=None, tools=None
):
    """Feed `text` cut at `cuts`; (reasoning, content, calls assembled from deltas, parser)."""
    parser = answer_parser(fmt, lambda k: f"call_{k}", calls, thinking, tools)
    assert parser is not None
    bounds = [0, *cuts, len(text)]
    outputs = [parser.feed(text[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    outputs.append(parser.finish())
    assembled = assemble_calls(delta for _, _, deltas in outputs for delta in deltas)
    reasoning = "".join(r for r, _, _ in outputs)
    content = "".join(c for _, c, _ in outputs)
    return reasoning, content, list(assembled.values()), parser


def every_cut(fmt: ChatFormat, text: str, **kwargs):
    """The parse of `text` whole, checked to be the same cut anywhere and char by char."""
    whole = parse(fmt, text, [], **kwargs)
    for cuts in [[i] for i in range(1, len(text))] + [list(range(1, len(text)))]:
        got = parse(fmt, text, cuts, **kwargs)
        assert got[:3] == whole[:3], cuts
        assert got[3].tool_calls() == whole[3].tool_calls()
    return whole


@needs_templates
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_family_is_told_by_the_templates_markers(name):
    fmt = template(name).format
    assert (fmt.family, fmt.args_form) == FAMILIES[name]
    assert detect_family(None) == HERMES


@needs_templates
def test_every_template_in_the_folder_gets_its_family():
    names = sorted(p.stem for p in TEMPLATES.glob("*.jinja"))
    assert len(names) >= 70
    got = {name: template(name).format for name in names}
    assert {n for n, fmt in got.items() if fmt.family != HERMES} == NOT_HERMES
    assert {n: (got[n].family, got[n].args_form) for n in NOT_HERMES} == {
        n: FAMILIES[n] for n in NOT_HERMES
    }
    # what `llmq models` shows
    assert got["Qwen3.5-4B"].name == "qwen3_xml"
    assert got["deepseek-ai-DeepSeek-V3.1"].name == "deepseek_v3_1"
    assert got["Mistral-Small-3.2-24B-Instruct-2506"].name == "mistral ([ARGS] form)"


@needs_templates
@pytest.mark.parametrize(
    "name",
    [
        "meta-llama-Llama-3.1-8B-Instruct",
        "meta-llama-Llama-3.3-70B-Instruct",
        "mistralai-Mistral-Nemo-Instruct-2407",
        "Mistral-Small-3.2-24B-Instruct-2506",
        "unsloth-mistral-Devstral-Small-2507",
        "openai-gpt-oss-120b",
    ],
)
def test_a_call_the_template_renders_parses_back_however_it_is_cut(name):
    message = {"role": "assistant", "content": "", "tool_calls": [CALL]}
    if name.startswith("meta-llama") or name.startswith("mistralai-Mistral-Nemo"):
        message["content"] = None
    text = rendered_answer(name, message)
    fmt = template(name).format
    reasoning, content, calls, parser = every_cut(fmt, text)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", ARGUMENTS)]
    assert parser.tool_calls()[0]["function"]["arguments"] == calls[0]["arguments"]
    assert content == "" and parser.complete


@needs_templates
def test_llama3_after_the_python_tag_and_a_plain_answer():
    fmt = template("meta-llama-Llama-3.1-8B-Instruct").format
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}'
    _, content, calls, _ = every_cut(fmt, text)
    assert content == "" and calls[0]["arguments"] == '{"city": "Rome"}'
    answer = rendered_answer(
        "meta-llama-Llama-3.1-8B-Instruct", {"role": "assistant", "content": "{It is} sunny."}
    )
    _, content, calls, _ = every_cut(fmt, answer)
    assert content == "{It is} sunny." and calls == []
    # a JSON answer that is no call is content, held back only until that is known
    _, content, calls, _ = every_cut(fmt, '{"answer": 42}')
    assert content == '{"answer": 42}' and calls == []


@needs_templates
def test_mistral_content_before_the_calls_and_several_calls():
    fmt = template("mistralai-Mistral-Nemo-Instruct-2407").format
    second = {**CALL, "id": "xyz987abc", "function": {"name": "get_time", "arguments": "{}"}}
    text = rendered_answer(
        "mistralai-Mistral-Nemo-Instruct-2407",
        {"role": "assistant", "content": None, "tool_calls": [CALL, second]},
    )
    _, content, calls, _ = every_cut(fmt, "Let me check. " + text)
    assert content == "Let me check."
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert calls[1]["arguments"] == "{}"
    _, content, calls, _ = every_cut(fmt, "No [TOOL_ here")
    assert content == "No [TOOL_ here" and calls == []


@needs_templates
def test_harmony_thinking_final_answer_and_the_models_own_call_header():
    fmt = template("openai-gpt-oss-120b").format
    chat = template("openai-gpt-oss-120b")
    turns = [{"role": "user", "content": "Hi"}]
    prompt = chat.render(turns, add_generation_prompt=True)
    full = chat.render(
        turns + [{"role": "assistant", "thinking": "Greet back.", "content": "Hello!"}],
        add_generation_prompt=False,
    )
    assert prompt.endswith("<|start|>assistant") and full.startswith(prompt)
    answer = full[len(prompt) :]
    reasoning, content, calls, parser = every_cut(fmt, answer, calls=False)
    assert (reasoning, content, calls) == ("Greet back.", "Hello!", [])
    [(start, end)] = parser.reasoning_spans
    assert answer[start:end] == "<|channel|>analysis<|message|>Greet back.<|end|>"
    # gpt-oss writes the recipient in the channel's header, with <|constrain|>
    own = (
        "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant"
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Oslo"}<|call|>'
    )
    reasoning, content, calls, parser = every_cut(fmt, own)
    assert reasoning == "Need weather." and content == ""
    assert calls == [{"id": "call_0", "name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    # a built-in tool's call is dropped; a plain text is the answer
    _, content, calls, _ = every_cut(
        fmt, "<|channel|>commentary to=browser.search<|message|>{}<|call|>"
    )
    assert content == "" and calls == []
    assert every_cut(fmt, "Just text.")[1] == "Just text."


def test_thinking_tokens_are_those_inside_the_block_tags_included():
    text_tokens = ["<think>", "\nI", " think", "</", "think>", "\n\n", "Yes", "."]
    spans, at = [], 0
    parser = answer_parser(ChatFormat(), lambda k: "", False, False)
    for piece in text_tokens:
        parser.feed(piece)
        spans.append((at, at + len(piece)))
        at += len(piece)
    parser.finish()
    assert parser.reasoning == "I think" and parser.content == "Yes."
    assert reasoning_tokens(spans, parser.reasoning_spans) == 5
    assert reasoning_tokens([(0, 3), (3, 3)], [[0, None]]) == 2  # still open: to the end


# ------------------------------------------------------------------ grammars


MARKERS = [
    "[TOOL_CALLS]",
    "[ARGS]",
    "[CALL_ID]",
    "<|python_tag|>",
    "<|channel|>",
    "<|message|>",
    "<|start|>",
    "<|end|>",
    "<|constrain|>",
    "<|call|>",
    "<|return|>",
]


@pytest.fixture(scope="module")
def marked(smollm2_metadata) -> Tokenizer:
    """SmolLM2's vocabulary with the families' markers added as control tokens."""
    meta = dict(smollm2_metadata)
    meta["tokenizer.ggml.tokens"] = list(meta["tokenizer.ggml.tokens"]) + MARKERS
    meta["tokenizer.ggml.token_type"] = list(meta["tokenizer.ggml.token_type"]) + [3] * len(MARKERS)
    return Tokenizer.from_metadata(meta)


@pytest.fixture(scope="module")
def vocabs(marked, smollm2_tokenizer) -> dict[str, tuple[Tokenizer, GrammarVocab]]:
    """The markers as control tokens ("tokens"), or spelled in text ("text")."""
    plain = smollm2_tokenizer
    return {
        "tokens": (marked, GrammarVocab(marked, marked.vocab_size)),
        "text": (plain, GrammarVocab(plain, plain.vocab_size)),
    }


def accepter(vocabs, kind: str, name: str):
    """The template's format on that vocabulary, and whether a grammar takes a text."""
    tokenizer, vocab = vocabs[kind]
    fmt = ChatTemplate((TEMPLATES / f"{name}.jinja").read_text(), tokenizer).format
    assert bool(fmt.marker_ids) == (kind == "tokens")

    def accepts(constraint, text: str) -> bool:
        matcher = llguidance.LLMatcher(vocab.lltokenizer, constraint.grammar)
        assert not matcher.is_error(), matcher.get_error()
        ids = tokenizer.encode(text, add_special=False, parse_special=True)
        return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()

    return fmt, accepts


@needs_templates
@pytest.mark.parametrize("kind", ["tokens", "text"])
@pytest.mark.parametrize(
    "name",
    [
        "meta-llama-Llama-3.1-8B-Instruct",
        "mistralai-Mistral-Nemo-Instruct-2407",
        "Mistral-Small-3.2-24B-Instruct-2506",
    ],
)
def test_each_familys_grammar_takes_its_calls_and_nothing_else(name, kind, vocabs):
    fmt, accepts = accepter(vocabs, kind, name)
    if fmt.family == LLAMA3:
        text = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'
    elif fmt.args_form:
        text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}'
    else:
        text = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]'
    for choice in ("required", "auto", {"type": "function", "function": {"name": "get_weather"}}):
        grammar = tool_grammar([WEATHER], choice, True, fmt)
        assert accepts(grammar, text), choice
        assert not accepts(grammar, text.replace('"days": 3', '"days": "3"'))
        assert not accepts(grammar, text.replace("get_weather", "get_time"))
    auto = tool_grammar([WEATHER], "auto", True, fmt)
    assert accepts(auto, "It is sunny.")
    if fmt.family == MISTRAL:
        assert accepts(auto, "Let me see. " + text)
    required = tool_grammar([WEATHER], "required", True, fmt)
    assert not accepts(required, "It is sunny.")


@needs_templates
@pytest.mark.parametrize("kind", ["tokens", "text"])
def test_harmonys_grammar_takes_thinking_then_a_call_or_a_final_answer(kind, vocabs):
    fmt, accepts = accepter(vocabs, kind, "openai-gpt-oss-120b")
    call = (
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Oslo"}'
    )
    thinking = "<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant"
    final = "<|channel|>final<|message|>Hello!"
    required = tool_grammar([WEATHER], "required", True, fmt)
    auto = tool_grammar([WEATHER], "auto", True, fmt)
    assert accepts(required, call)
    assert accepts(required, thinking + call)
    assert not accepts(required, thinking + final)
    assert accepts(auto, thinking + final)
    assert not accepts(auto, call.replace("Oslo", 'Oslo", "x": "1'))


def test_harmony_vocabularies_end_turns_at_return_and_call_not_at_end(marked, smollm2_metadata):
    """As llama.cpp's llama-vocab.cpp: with <|return|> and <|call|> present, <|end|> only
    ends a message (the answer goes on); alone (Phi-3's) it still ends the turn."""
    ids = {marked.token_text(i): i for i in marked.stop_ids}
    assert "<|return|>" in ids and "<|call|>" in ids and "<|end|>" not in ids
    meta = dict(smollm2_metadata)
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], "<|end|>"]
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], 3]
    phi = Tokenizer.from_metadata(meta)
    assert phi.vocab_size - 1 in phi.stop_ids


@needs_templates
def test_gpt_oss_reads_a_past_turns_thinking_beside_its_calls():
    """gpt-oss's template takes thinking from `thinking` and refuses content beside it in a
    turn with calls: the turn's reasoning_content is its thinking, its content dropped."""
    from runtime.tool_calls import chat_for_template

    chat = template("openai-gpt-oss-120b")
    turns = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,  # as OpenAI's clients send a turn of calls
            "reasoning_content": "Need weather.",
            "tool_calls": [CALL],
        },
        {"role": "tool", "tool_call_id": CALL["id"], "content": "sunny"},
    ]
    messages, extra = chat_for_template(turns, [WEATHER], chat.knows_tools, chat.format)
    prompt = chat.render(messages, add_generation_prompt=True, **extra)
    assert "<|channel|>analysis<|message|>Need weather.<|end|>" in prompt
    assert "<|start|>assistant to=functions.get_weather<|channel|>commentary json" in prompt


def test_mistrals_args_form_calls_in_a_row_and_content_after_them():
    fmt = ChatFormat(MISTRAL, True)
    text = (
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"} \n[TOOL_CALLS]get_time[CALL_ID]'
        "abc123def[ARGS]{}\n Done, a b."
    )
    _, content, calls, parser = every_cut(fmt, text)
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", '{"city": "Oslo"}'),
        ("get_time", "{}"),
    ]
    assert content == "Done, a b." and parser.complete
