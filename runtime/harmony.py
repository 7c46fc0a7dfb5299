"""gpt-oss's harmony format: the parser of an answer's messages and the grammar of its calls.

The prompt ends with `<|start|>assistant`, so an answer is one or more messages, each a
header, `<|message|>`, a body and its end (`<|end|>`, after which `<|start|>assistant` opens
the next; `<|call|>` or `<|return|>`, which end the turn):

    <|channel|>analysis<|message|>The user wants...<|end|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>
    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "P"}<|call|>

The `analysis` channel is thinking (`reasoning_content`), `final` and a plain `commentary`
(a preamble) are content, and a message to `functions.NAME` (in the channel's header, as
the model writes it, or in the role's, as gpt-oss's template renders past calls) is a call
whose body is its JSON arguments. As llama.cpp's gpt-oss parser does, a message to any
other recipient (a built-in tool) is dropped. Headers are never shown; a body's end is held
back while it may still be a marker.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from runtime.chat_formats import ChatFormat
from runtime.constraints import GRAMMAR, JSON_FORMAT, Constraint
from runtime.json_calls import JsonCallParser, json_value_end, partial_suffix

CHANNEL, MESSAGE, START, END, CONSTRAIN = (
    "<|channel|>",
    "<|message|>",
    "<|start|>",
    "<|end|>",
    "<|constrain|>",
)
CALL, RETURN = "<|call|>", "<|return|>"
_ENDS = (END, CALL, RETURN)
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z]+)")
_RECIPIENT = re.compile(r"to=([A-Za-z0-9_.\-]+)")
_HEAD_STARTS = ("<|", "to=", " to=")


class HarmonyParser(JsonCallParser):
    """Splits a harmony answer into thinking, content and calls as it is generated.

    `feed(text)` and `finish()` return (reasoning, content, tool-call deltas).
    `reasoning_spans` are the [start, end) character offsets of the analysis messages in
    the text fed (end None while one is open), for counting thinking tokens.
    """

    thinks = True  # gpt-oss may always think: its analysis channel

    def __init__(self, call_id: Callable[[int], str], calls: bool = True) -> None:
        super().__init__(call_id)
        self.takes_calls = calls  # False: the request offered no tools; a call is dropped
        self.reasoning: str | None = None
        self.reasoning_spans: list[list[int | None]] = []
        self._state = "header"  # header -> analysis | content | call | dropped -> ... | plain
        self._fed = 0  # characters fed so far

    def feed(self, text: str) -> tuple[str, str, list[dict[str, Any]]]:
        self._buffer += text
        self._fed += len(text)
        parts: dict[str, list[str]] = {"analysis": [], "content": []}
        deltas: list[dict[str, Any]] = []
        while self._step(parts, deltas):
            pass
        return self._add(parts, deltas)

    def finish(self) -> tuple[str, str, list[dict[str, Any]]]:
        parts: dict[str, list[str]] = {"analysis": [], "content": []}
        deltas: list[dict[str, Any]] = []
        held, state = self._buffer, self._state
        if state in ("analysis", "content"):
            parts[state].append(held[: len(held) - _held_end(held)])
        elif state == "call" and self.calls:
            self._send(held[: len(held) - _held_end(held)].rstrip(), deltas)
            arguments = self.calls[-1]["function"]["arguments"]
            self.calls[-1]["complete"] = json_value_end(arguments) == len(arguments)
        elif state == "plain":
            parts["content"].append(held)
        self._buffer, self._state = "", "done"
        return self._add(parts, deltas)

    def _add(
        self, parts: dict[str, list[str]], deltas: list[dict[str, Any]]
    ) -> tuple[str, str, list[dict[str, Any]]]:
        reasoning, content = "".join(parts["analysis"]), "".join(parts["content"])
        if reasoning:
            self.reasoning = (self.reasoning or "") + reasoning
        self.content += content
        return reasoning, content, deltas

    def _step(self, parts: dict[str, list[str]], deltas: list[dict[str, Any]]) -> bool:
        buffer, state = self._buffer, self._state
        if state == "plain":
            parts["content"].append(buffer)
            self._buffer = ""
            return False
        if state == "done":
            self._buffer = ""
            return False
        if state == "header":
            return self._header(buffer, deltas)
        ends = [(buffer.find(e), e) for e in _ENDS if e in buffer]
        if not ends:  # the body goes on: show all but what may be the start of its end
            body = buffer[: len(buffer) - _held_end(buffer)]
            if state == "call":
                self._send(body.rstrip(), deltas)
            else:
                self._buffer = buffer[len(body) :]
                if state != "dropped":
                    parts[state].append(body)
            return False
        at, end = min(ends)
        body = buffer[:at]
        if state == "call":
            self._send(body.rstrip(), deltas)
            self.calls[-1]["complete"] = True
        elif state != "dropped":
            parts[state].append(body)
        if state == "analysis":
            self.reasoning_spans[-1][1] = self._offset() + at + len(end)
        self._buffer = buffer[at + len(end) :]
        self._state = "header" if end == END else "done"
        return True

    def _header(self, buffer: str, deltas: list[dict[str, Any]]) -> bool:
        at = buffer.find(MESSAGE)
        if at < 0:
            head = buffer.lstrip()
            if head and not any(s.startswith(head) or head.startswith(s) for s in _HEAD_STARTS):
                self._state = "plain"  # no harmony message: the text is the answer
                return True
            return False
        header = buffer[:at]
        channels = _CHANNEL.findall(header)
        channel = channels[-1] if channels else None
        recipient = _RECIPIENT.search(header)
        start = self._offset()
        self._buffer = buffer[at + len(MESSAGE) :]
        to_function = recipient is not None and recipient.group(1).startswith("functions.")
        if to_function and self.takes_calls:
            assert recipient is not None
            self._open(recipient.group(1).removeprefix("functions."), deltas)
            self._state = "call"
        elif recipient is not None and recipient.group(1) != "assistant":
            self._state = "dropped"  # a built-in tool's call: not ours to run
        elif channel == "analysis":
            self.reasoning = self.reasoning or ""
            self.reasoning_spans.append([start, None])
            self._state = "analysis"
        else:
            self._state = "content"
        return True

    def _offset(self) -> int:
        """Where the buffer starts in the text fed."""
        return self._fed - len(self._buffer)


def _held_end(text: str) -> int:
    return max(partial_suffix(text, end) for end in _ENDS)


# ------------------------------------------------------------------ grammar


def harmony_grammar(
    fmt: ChatFormat, functions: Sequence[Mapping[str, Any]], auto: bool
) -> Constraint:
    """Calls held valid: maybe an analysis message first, then (with `auto`) a final
    message or a call, else a call: `<|channel|>commentary to=functions.NAME
    <|constrain|>json<|message|>` and arguments matching the function's parameters."""
    m = fmt.grammar_literal
    lines = []
    for i, function in enumerate(functions):
        schema = {**(function.get("parameters") or {"type": "object", "properties": {}})}
        schema.setdefault("x-guidance", JSON_FORMAT)
        head = json.dumps(f"commentary to=functions.{function['name']} ")
        lines.append(
            f'fn_{i}: {head} {m(CONSTRAIN)} "json" {m(MESSAGE)} %json {json.dumps(schema)}'
        )
    if fmt.is_token(END):
        thinking = f"TEXT {m(END)}"
    else:
        thinking = "thinking"
        lines.append(f"thinking[lazy]: TEXT {m(END)}")
    calls = " | ".join(f"fn_{i}" for i in range(len(functions)))
    answer = f'call | {m(CHANNEL)} "final" {m(MESSAGE)} TEXT' if auto else "call"
    head = [
        f"start: analysis? ({answer})",
        f'analysis: {m(CHANNEL)} "analysis" {m(MESSAGE)} {thinking} {m(START)} "assistant"',
        f"call: {m(CHANNEL)} ({calls})",
        "TEXT: /(.|\\n)*/",
    ]
    return Constraint(GRAMMAR, "\n".join(head + lines) + "\n", param="tools")
