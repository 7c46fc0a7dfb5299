"""Chat templates rendered as llama.cpp renders them: the cases of llama.cpp's own
tests/test-chat-template.cpp (tests/fixtures/reference/llama_cpp_chat_templates.json, made
by tests/fixtures/make_chat_template_cases.py), each a real model's template, its BOS/EOS
tokens and the prompt llama.cpp's Jinja path gives for the same conversation, including its
rule for templates without a system role (the system text opens the next user message)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.chat_template import ChatTemplate

FIXTURE = Path(__file__).parents[1] / "fixtures/reference/llama_cpp_chat_templates.json"
DOC = json.loads(FIXTURE.read_text(encoding="utf-8"))


@pytest.mark.parametrize("case", DOC["cases"], ids=[c["name"] for c in DOC["cases"]])
def test_the_prompt_is_llama_cpps(case):
    template = ChatTemplate(
        case["template"], bos_token=case["bos_token"], eos_token=case["eos_token"]
    )
    messages = DOC["conversation"] + case["extra_messages"]
    assert template.render(messages, add_generation_prompt=True) == case["expected"]


def test_a_template_that_keeps_the_system_role_is_left_as_it_is():
    chatml = next(c for c in DOC["cases"] if c["name"].startswith("teknium/"))
    template = ChatTemplate(chatml["template"])
    assert template.supports_system_role
    rendered = template.render(DOC["conversation"][:2])
    assert rendered.startswith("<|im_start|>system\nYou are a helpful assistant<|im_end|>")


# ------------------------------------------------ the real templates llama.cpp carries

TEMPLATES = (
    Path(__file__).parents[2]
    / "build/llama-cpp-python-src/llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates"
)
# tools not in OpenAI's shape: Cohere's `parameter_definitions`; firefunction's template
# reads its own `functions` variable even without tools, so it is not checked at all
OWN_TOOL_SHAPES = {"CohereForAI-c4ai-command-r-plus-tool_use"}
OWN_VARIABLES = {"fireworks-ai-llama-3-firefunction-v2"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def _real_templates() -> list[Path]:
    if not TEMPLATES.is_dir():
        return []
    return [p for p in sorted(TEMPLATES.glob("*.jinja")) if p.stem not in OWN_VARIABLES]


@pytest.mark.skipif(not TEMPLATES.is_dir(), reason="`make test` unpacks llama.cpp's templates")
def test_llama_cpp_carries_the_templates_we_check():
    assert len(_real_templates()) >= 69


@pytest.mark.parametrize("path", _real_templates(), ids=lambda p: p.stem)
def test_every_real_template_renders_a_conversation_and_its_tools(path):
    template = ChatTemplate(
        path.read_text(encoding="utf-8"), bos_token="<s>", eos_token="</s>", model_name=path.stem
    )
    conversation = DOC["conversation"][:3] + [{"role": "user", "content": "Weather in Paris?"}]
    prompt = template.render(conversation, add_generation_prompt=True)
    for message in conversation:
        assert message["content"].strip() in prompt
    if path.stem in OWN_TOOL_SHAPES:
        return
    with_tools = template.render(conversation, add_generation_prompt=True, tools=TOOLS)
    if template.knows_tools:
        assert "get_weather" in with_tools
