"""Tool calls of DeepSeek R1 (and its distills) and DeepSeek V3.1: the parser, the grammar and
the tools' description for templates that do not render tools themselves.

As their templates render a past call (`deepseek_r1`, `deepseek_v3_1`), a call list is

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

for R1, and for V3.1 `<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
<｜tool▁call▁end｜>` per call (no type, no code fence, no newline between calls). The markers
may be control tokens of the vocabulary; the parser sees their text (`ChatFormat.marker_text`)
and the grammar names them by id. Deltas are OpenAI's, as the other parsers give them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from runtime.chat_formats import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    DEEPSEEK_R1,
    TOOL_SEP,
    ChatFormat,
)
from runtime.constraints import GRAMMAR, JSON_FORMAT, Constraint
from runtime.json_calls import MarkedCallParser, text_then

FENCE = "```"
# a call's head up to its arguments' first character: then its name is known
_R1_HEAD = re.compile(
    r"\s*(?:function)?\s*" + re.escape(TOOL_SEP) + r"\s*([^\n`]+?)\s*```(?:json)?\s*(?=\{)"
)
_V31_HEAD = re.compile(r"\s*([^\s<]+?)\s*" + re.escape(TOOL_SEP) + r"\s*(?=\S)")


class DeepSeekParser(MarkedCallParser):
    """Content until `<｜tool▁calls▁begin｜>`, then its calls, each JSON arguments."""

    OPENING = CALLS_BEGIN

    def __init__(self, call_id: Callable[[int], str], r1: bool = True) -> None:
        super().__init__(call_id)
        self._head = _R1_HEAD if r1 else _V31_HEAD
        # states: text -> calls -> head -> arguments -> call_end -> calls ... -> text

    def _step(self, out: list[str], deltas: list[dict[str, Any]]) -> bool:
        """One move of the state machine; False when it needs more text."""
        state = self._state
        if state == "text":
            return self._text(out, "calls")
        if state == "arguments":
            if not self._buffer or not self._arguments(deltas):
                return False
            self._state = "call_end"
            return True
        buffer = self._buffer = self._buffer.lstrip()
        if not buffer:
            return False
        if state == "head":
            head = self._head.match(buffer)
            if head is None:
                if CALL_END in buffer:  # no call after all: dropped
                    self._buffer, self._state = buffer.split(CALL_END, 1)[1], "calls"
                    return True
                return False
            self._open(head.group(1), deltas)
            self._buffer, self._state = buffer[head.end() :], "arguments"
            return True
        if state == "call_end":  # R1's closing fence, then the call's end marker
            if buffer.startswith(FENCE):
                buffer = self._buffer = buffer[len(FENCE) :].lstrip()
            if buffer.startswith(CALL_END):
                self._buffer, self._state = buffer[len(CALL_END) :], "calls"
                return True
            return False if CALL_END.startswith(buffer) or FENCE.startswith(buffer) else self._end()
        # state == "calls": the next call, or the list's end
        for marker, nxt in ((CALL_BEGIN, "head"), (CALLS_END, "text")):
            if buffer.startswith(marker):
                self._buffer, self._state = buffer[len(marker) :], nxt
                self._after_calls = nxt == "text"
                return True
        if CALL_BEGIN.startswith(buffer) or CALLS_END.startswith(buffer):
            return False
        return self._end()

    def _end(self) -> bool:
        """Text where a marker should be: the calls end here, the rest is text."""
        self._state, self._after_calls = "text", True
        return True


# ------------------------------------------------------------------ grammar


def deepseek_grammar(
    fmt: ChatFormat, functions: Sequence[Mapping[str, Any]], auto: bool, more: bool
) -> Constraint:
    """The Lark grammar holding DeepSeek calls valid: the list's markers, each call's head
    and its arguments matching the function's parameters; `auto` leaves the answer free
    unless it starts the list; `more` allows several calls."""
    m = fmt.grammar_literal
    r1 = fmt.family == DEEPSEEK_R1
    lines = []
    for i, function in enumerate(functions):
        schema = {**(function.get("parameters") or {"type": "object", "properties": {}})}
        schema.setdefault("x-guidance", JSON_FORMAT)
        arguments = f"%json {json.dumps(schema)}"
        if r1:
            head = json.dumps(f"{function['name']}\n{FENCE}json\n")
            body = f'"function" {m(TOOL_SEP)} {head} {arguments} "\\n{FENCE}"'
        else:
            body = f"{json.dumps(function['name'])} {m(TOOL_SEP)} {arguments}"
        lines.append(f"fn_{i}: {body} {m(CALL_END)}")
    between = '"\\n"? ' if r1 else ""  # R1's template writes a newline between calls
    calls = "call" + (f" ({between}call)*" if more else "") + f" {m(CALLS_END)}"
    start = f"start: {m(CALLS_BEGIN)} {calls}\n"
    if auto:
        start = f"start: TEXT | {text_then(fmt, CALLS_BEGIN)} {calls}\n"
        if not fmt.is_token(CALLS_BEGIN):
            start += f"text_then_marker[lazy]: TEXT {m(CALLS_BEGIN)}\n"
    alternatives = " | ".join(f"fn_{i}" for i in range(len(functions)))
    head = [start + "TEXT: /(.|\\n)*/", f"call: {m(CALL_BEGIN)} ({alternatives})"]
    return Constraint(GRAMMAR, "\n".join(head + lines) + "\n", param="tools")


# ------------------------------------------------------------------ prompt


def tools_intro(fmt: ChatFormat, tools: Sequence[Mapping[str, Any]]) -> str:
    """The tools and the call syntax for the system message, where the template does not
    render `tools` (DeepSeek's own templates do not; the words of llama.cpp's
    models/templates/llama-cpp-deepseek-r1.jinja for R1, DeepSeek's for V3.1)."""
    listed = json.dumps([t["function"] for t in tools], ensure_ascii=False, indent=2)
    if fmt.family == DEEPSEEK_R1:
        example = (
            f"{CALLS_BEGIN}{CALL_BEGIN}function{TOOL_SEP}example_function_name\n"
            f'{FENCE}json\n{{"arg1": "some_value"}}\n{FENCE}{CALL_END}{CALLS_END}'
        )
    else:
        example = (
            f"{CALLS_BEGIN}{CALL_BEGIN}example_function_name{TOOL_SEP}"
            f'{{"arg1": "some_value"}}{CALL_END}{CALLS_END}'
        )
    return (
        "You can call any of the following function tools to satisfy the user's requests: "
        f"{listed}\n\nExample function tool call syntax:\n\n{example}"
    )
