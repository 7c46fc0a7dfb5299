"""The API's check of a request on a model's text side (runtime/model_text.py): the
tool-call grammar it compiles is the one the worker will, in the model's family's format."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.chat_formats import HARMONY, MISTRAL, ChatFormat
from runtime.chat_template import ChatTemplate
from runtime.errors import InvalidSamplingParams
from runtime.model_text import ModelText
from runtime.request import GenerationSpec

PICK = {
    "type": "function",
    "function": {"name": "pick", "parameters": {"type": "object"}},
}
# a template that shows the tools itself (the tiny model's context is 256 tokens)
SHORT_TOOLS_TEMPLATE = (
    "{% for t in tools %}{{ t.function.name }} {% endfor %}"
    "{% for m in messages %}{{ m.content }}{% endfor %}"
)
CALLING = {"messages": [{"role": "user", "content": "pick"}], "tools": [PICK], "max_tokens": 8}


@pytest.mark.parametrize("family", [HARMONY, MISTRAL])
def test_a_familys_tool_grammar_is_compiled_on_the_models_vocabulary(tiny_llama_path: Path, family):
    """A marker named by a control token the vocabulary has compiles; one naming a token it
    lacks cannot compile on the worker, and is refused here (the Hermes grammar the
    model-less check compiles has no markers: it passed)."""
    text = ModelText.load(str(tiny_llama_path))
    text.chat_template = ChatTemplate(SHORT_TOOLS_TEMPLATE)
    marker = "<|message|>" if family == HARMONY else "[TOOL_CALLS]"
    spec = GenerationSpec.from_body(CALLING, chat=True)
    assert text.tokenizer.is_special(1)
    text.chat_template.format = ChatFormat(family, False, {1: marker})
    text.check(spec)
    text.chat_template.format = ChatFormat(family, False, {text.vocab_size: marker})
    with pytest.raises(InvalidSamplingParams, match="invalid grammar") as refused:
        text.check(spec)
    assert refused.value.param == "tools"
    no_calls = GenerationSpec.from_body({**CALLING, "tool_choice": "none"}, chat=True)
    text.check(no_calls)  # no grammar: nothing to compile
