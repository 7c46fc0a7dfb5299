"""ChatTemplate: Hugging Face rendering rules, named errors, and the sandbox."""

from __future__ import annotations

import datetime

import pytest

from runtime.chat_template import ChatTemplate, has_chat_template
from runtime.errors import (
    ChatTemplateError,
    ChatTemplateMissingError,
    ChatTemplateRenderError,
    ChatTemplateSyntaxError,
    InvalidChatMessagesError,
)

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
]


# toy templates that show only roles would lose a system message's text, so llama.cpp (and
# ChatTemplate.supports_system_role) would move it into the user turn: these use no system
TURNS = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


def render(source: str, messages=CHAT, **kwargs) -> str:
    return ChatTemplate(source, model_name="test-model").render(messages, **kwargs)


# ------------------------------------------------------------------ SmolLM2's real template


@pytest.fixture(scope="module")
def smollm2_template(smollm2_tokenizer) -> ChatTemplate:
    return ChatTemplate(smollm2_tokenizer.chat_template, smollm2_tokenizer, model_name="smollm2")


def test_smollm2_renders_chatml_with_generation_prompt(smollm2_template):
    assert smollm2_template.render(CHAT, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert not smollm2_template.render(CHAT).endswith("<|im_start|>assistant\n")


def test_smollm2_adds_its_default_system_prompt(smollm2_template):
    text = smollm2_template.render([{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )


def test_smollm2_prompt_tokenizes_to_control_tokens(smollm2_template, smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(smollm2_template.render(CHAT, add_generation_prompt=True))
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2  # <|im_start|>, <|im_end|>


def test_bos_and_eos_token_texts_come_from_the_tokenizer(smollm2_tokenizer):
    template = ChatTemplate("{{ bos_token }}|{{ eos_token }}", smollm2_tokenizer)
    assert template.render([]) == "<|im_start|>|<|im_end|>"


# ------------------------------------------------------------------ Gemma: no template


@pytest.mark.slow
def test_gemma3_has_no_template_and_says_so(gemma3_metadata, gemma3_tokenizer):
    source = gemma3_metadata.get("tokenizer.chat_template")
    template = ChatTemplate(source, gemma3_tokenizer, model_name="gemma-3-270m")
    assert not template.available
    with pytest.raises(ChatTemplateMissingError, match="gemma-3-270m has no chat template"):
        template.render(CHAT, add_generation_prompt=True)


@pytest.mark.slow
def test_has_chat_template_reads_the_gguf_header_or_the_registry(
    smollm2_gguf_path, gemma3_gguf_path, tmp_path, monkeypatch
):
    assert has_chat_template(str(smollm2_gguf_path))
    assert not has_chat_template(str(gemma3_gguf_path))
    registry = tmp_path / "models.toml"  # a registry entry's template stands in for the GGUF's
    registry.write_text(
        f'[models.gemma-chat]\npath = "{gemma3_gguf_path}"\nchat_template = "{{{{ messages }}}}"\n'
    )
    monkeypatch.setenv("LLMQ_MODELS", str(registry))
    assert has_chat_template("gemma-chat")


# ------------------------------------------------------------------ rendering rules


def test_content_parts_are_joined_into_one_string():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert render("{{ messages[0]['content'] }}", messages) == "ab"


def test_trim_and_lstrip_blocks_like_hugging_face():
    # without them this would render "\n    system\n\n    user\n"
    source = "{% for m in messages %}\n    {% if m %}{{ m.role }}{% endif %}\n{% endfor %}"
    assert render(source, TURNS) == "userassistant"


def test_tojson_does_not_escape_html_and_takes_options():
    assert render("{{ {'a': '<b>'} | tojson }}", []) == '{"a": "<b>"}'
    assert render("{{ [1, 2] | tojson(indent=1) }}", []) == "[\n 1,\n 2\n]"


def test_strftime_now_and_extra_variables():
    year = str(datetime.datetime.now().year)
    assert render("{{ strftime_now('%Y') }}", []) == year
    assert render("{{ tools | length }} {{ date }}", [], tools=[1, 2], date="d") == "2 d"


def test_loop_controls_are_enabled():
    source = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}"
    assert render(source + "{% endfor %}", TURNS) == "user"


# ------------------------------------------------------------------ errors


def test_raise_exception_becomes_a_named_error():
    source = "{% if messages[-1]['role'] == 'user' %}{{ raise_exception('user last!') }}{% endif %}"
    with pytest.raises(ChatTemplateRenderError, match="user last!"):
        render(source)


def test_runtime_failures_in_the_template_are_named_errors():
    with pytest.raises(ChatTemplateRenderError, match="test-model"):
        render("{{ messages[0]['content'] + 1 }}")
    with pytest.raises(ChatTemplateRenderError):
        render("{{ nothing.here }}")


def test_syntax_errors_surface_on_render_not_on_load():
    template = ChatTemplate("{% for m in messages %}", model_name="broken")
    assert not template.available
    with pytest.raises(ChatTemplateSyntaxError, match="broken"):
        template.render(CHAT)


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ("hello", "list"),
        ([["user", "hi"]], r"messages\[0\]"),
        ([{"role": 1, "content": "hi"}], r"messages\[0\]\.role"),
        ([{"content": "hi"}], r"role must be a string"),
        ([{"role": "user", "content": {"text": "hi"}}], "content must be"),
        ([{"role": "user"}], "content must be"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "text parts"),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "text must be a string"),
    ],
)
def test_malformed_messages_are_named_errors(messages, match):
    with pytest.raises(InvalidChatMessagesError, match=match):
        render("{{ messages }}", messages)


def test_tool_call_turns_may_have_no_content():
    messages = [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]
    assert render("{{ messages[0]['content'] is none }}", messages) == "True"


# ------------------------------------------------------------------ sandbox


def test_sandbox_blocks_escapes_to_python_internals():
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateRenderError, match="unsafe"):
        render(escape)
    assert "class" not in render("{{ ''.__class__ }}")  # unsafe attribute reads as undefined
    with pytest.raises(ChatTemplateError):
        render("{{ cycler.__init__.__globals__ }}")


def test_sandbox_is_immutable():
    with pytest.raises(ChatTemplateRenderError):
        render("{{ messages.append({'role': 'x'}) }}")
