"""Which format a model writes its tool calls and thinking in, read from its chat template.

As llama.cpp's `common_chat_templates` does, the family is told by markers in the template
text, once per model (`ChatTemplate.format`), never per request:

- `harmony` (gpt-oss): the template speaks of `<|channel|>`; thinking is the `analysis`
  channel, the answer the `final` one, a call a `commentary` message `to=functions.NAME`
  (`runtime.harmony`).
- `mistral`: `[TOOL_CALLS]`, then a JSON list of `{"name", "arguments"}` (Mistral Nemo), or
  `NAME[ARGS]{...}` per call where the template writes `[ARGS]` (Mistral Small 3.2,
  Devstral, Ministral 3) (`runtime.json_calls`).
- `llama3`: the template has an `ipython` role (Llama 3.1 / 3.2 / 3.3): the whole answer
  is one `{"name": ..., "parameters": {...}}`, maybe after `<|python_tag|>`.
- `qwen3_xml`: the template writes `<tool_call>`, `<function=` and `<parameter=` (with
  newlines between the tags): `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n
  </parameter>\n...</function>\n</tool_call>`, the values typed by the tool's schema
  (Qwen3-Coder, Qwen3.5 / 3.6, Nemotron Nano 3, StepFun 3.5) (`runtime.xml_calls`).
- `deepseek_r1`, `deepseek_v3_1`: the template writes `<｜tool▁calls▁begin｜>`; R1 (and
  its distills) a call as `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` and its arguments
  in a ```json fence, V3.1 as `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}`
  (`runtime.deepseek_calls`).
- `hermes`: everything else: `<tool_call>{"name", "arguments"}</tool_call>` blocks (Qwen 2.5,
  Qwen3, Hermes, and the fallback prompt of `runtime.tool_calls` for templates without
  tools). Families whose own formats are not parsed yet (Functionary, DeepSeek V3.2 / V4's
  DSML, Kimi, GLM, MiniMax, Command R, Granite, ...) are held to this one by the grammar too.

Any family but harmony may think first in a leading `<think>` block (`runtime.reasoning`).

A marker that is one control token of the model's vocabulary (`[TOOL_CALLS]` in Mistral's,
`<|python_tag|>` in Llama 3's, DeepSeek's where its GGUF marks them so) is no text to the
detokenizer: `marker_text` gives its text back to the parsers token by token, and the
grammar names it by id (`grammar_literal`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.tokenizer import Tokenizer

HERMES, LLAMA3, MISTRAL, HARMONY = "hermes", "llama3", "mistral", "harmony"
QWEN3_XML, DEEPSEEK_R1, DEEPSEEK_V3_1 = "qwen3_xml", "deepseek_r1", "deepseek_v3_1"
FAMILIES = (HERMES, LLAMA3, MISTRAL, HARMONY, QWEN3_XML, DEEPSEEK_R1, DEEPSEEK_V3_1)

PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
HARMONY_MARKERS = ("<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|constrain|>")
HARMONY_ENDS = ("<|call|>", "<|return|>")
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, TOOL_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DEEPSEEK_MARKERS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, TOOL_SEP)

# the markers each family's parser must see as text
_MARKERS = {
    HERMES: (),
    LLAMA3: (PYTHON_TAG,),
    MISTRAL: (TOOL_CALLS, ARGS, CALL_ID),
    HARMONY: HARMONY_MARKERS + HARMONY_ENDS,
    QWEN3_XML: (),
    DEEPSEEK_R1: DEEPSEEK_MARKERS,
    DEEPSEEK_V3_1: DEEPSEEK_MARKERS,
}
# llama.cpp's Qwen3-Coder check (common/chat.cpp): the three tags, not written unspaced
_QWEN3_XML_MARKERS = ("<tool_call>", "<function=", "<parameter=")
_QWEN3_XML_UNSPACED = "'<tool_call><function=' ~ tool_call.name ~ '>'"


def detect_family(template: str | None) -> str:
    """The family a chat template's text belongs to (llama.cpp's checks, in its order)."""
    source = template or ""
    if "<|channel|>" in source:
        return HARMONY
    if TOOL_CALLS in source:
        return MISTRAL
    if all(m in source for m in _QWEN3_XML_MARKERS) and _QWEN3_XML_UNSPACED not in source:
        return QWEN3_XML
    if CALLS_BEGIN in source:  # R1 fences its arguments as ```json, V3.1 does not
        return DEEPSEEK_R1 if "```json" in source else DEEPSEEK_V3_1
    # Functionary v3.1 has Llama 3.1's ipython role but its own <function=...> calls
    if "<|start_header_id|>ipython<|end_header_id|>" in source and "<function=" not in source:
        return LLAMA3
    return HERMES


@dataclass(frozen=True)
class ChatFormat:
    """A model's family, whether its Mistral calls use `[ARGS]`, which of the family's
    markers are single control tokens of its vocabulary (id -> text), and how its template
    takes a past call's arguments."""

    family: str = HERMES
    args_form: bool = False  # Mistral: `[TOOL_CALLS]NAME[ARGS]{...}` rather than a list
    marker_ids: dict[int, str] = field(default_factory=dict)
    # the template adds a past call's arguments to its text as they are (DeepSeek R1's
    # Llama distill): it takes OpenAI's JSON string, not the object others take
    string_arguments: bool = False

    @classmethod
    def of(cls, template: str | None, tokenizer: Tokenizer | None = None) -> ChatFormat:
        family = detect_family(template)
        source = template or ""
        return cls(
            family,
            family == MISTRAL and ARGS in source,
            _control_markers(tokenizer, _MARKERS[family]) if tokenizer is not None else {},
            "['function']['arguments'] + " in source,
        )

    @property
    def name(self) -> str:
        """What `llmq models` shows."""
        return f"{self.family} ({ARGS} form)" if self.args_form else self.family

    def marker_text(self, token_id: int | None) -> str:
        """The text of a marker the detokenizer leaves out (a control token); else ""."""
        return self.marker_ids.get(token_id, "") if token_id is not None else ""

    def grammar_literal(self, text: str) -> str:
        """`text` in a Lark grammar: its token by id where it is one control token (a grammar
        can only produce such a token by naming it), else a quoted string."""
        for token_id, marker in self.marker_ids.items():
            if marker == text:
                return f"<[{token_id}]>"
        return json.dumps(text)

    def is_token(self, text: str) -> bool:
        return text in self.marker_ids.values()


def _control_markers(tokenizer: Tokenizer, markers: Iterable[str]) -> dict[int, str]:
    wanted = set(markers)
    if not wanted:
        return {}
    found = {}
    for token_id in range(tokenizer.vocab_size):
        text = tokenizer.token_text(token_id)
        if text in wanted and tokenizer.is_special(token_id):
            found[token_id] = text
    return found
