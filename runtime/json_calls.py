"""Tool calls written as JSON by Llama 3.x and Mistral models: the parsers and grammars.

- Llama 3.1 / 3.2 / 3.3 (`llama3`): the whole answer is one call,
  `{"name": "get_weather", "parameters": {"city": "Paris"}}`, maybe after `<|python_tag|>`
  (what their templates render a past call as, and what llama.cpp's parser takes; the
  template allows one call a turn).
- Mistral (`mistral`): `[TOOL_CALLS]` and then a JSON list,
  `[{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "..."}]` (Mistral Nemo),
  or, where the template writes `[ARGS]` (Mistral Small 3.2, Devstral, Ministral 3),
  `[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}` for each call.

The parsers have `runtime.tool_calls.ToolCallParser`'s interface (`feed`, `finish`,
`tool_calls`, `content`, `complete`, `repeated`), so the worker uses any of them alike. A
call's deltas are OpenAI's: its id and name once the name is known, then fragments of its
`arguments`, which join into exactly the JSON the model wrote. Nothing that may still be a
marker or a call's head is sent as content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from runtime.chat_formats import ARGS, CALL_ID, PYTHON_TAG, TOOL_CALLS, ChatFormat
from runtime.constraints import GRAMMAR, JSON_FORMAT, Constraint

_DECODER = json.JSONDecoder()
_NAME = r'"((?:[^"\\]|\\.)*)"'
_LLAMA_HEAD = re.compile(
    r'\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:\s*' + _NAME
    + r'\s*,\s*"(?:parameters|arguments)"\s*:\s*(?=\S)'
)  # fmt: skip
_MISTRAL_HEAD = re.compile(r'\{\s*"name"\s*:\s*' + _NAME + r'\s*,\s*"arguments"\s*:\s*(?=\S)')


def json_value_end(text: str) -> int | None:
    """Where the JSON value at the start of `text` ends; None while it is incomplete (or is
    no JSON). A number at the very end may go on, so it is not complete yet."""
    try:
        _, end = _DECODER.raw_decode(text)
    except json.JSONDecodeError:
        return None
    if end == len(text) and text[:1] not in ("{", "[", '"'):
        return None
    return end


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def json_type(value: Any) -> str:
    """The JSON name of a decoded value's type: a schema's `type` to check it against, and
    the word the API's errors use (api/body.py)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


class JsonCallParser:
    """What the JSON-call parsers share: the calls found so far and their deltas."""

    def __init__(self, call_id: Callable[[int], str]) -> None:
        self.call_id = call_id
        self.content = ""
        self.calls: list[dict[str, Any]] = []
        self.repeated = False  # the Hermes parser's notion; these formats do not loop
        self._buffer = ""
        self._sent = 0  # characters of the open call's arguments already sent

    @property
    def complete(self) -> bool:
        return all(call["complete"] for call in self.calls)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The content `text` completes and the calls' deltas, by as many moves of the
        parser's state machine (`_step`) as the text allows (Llama3Parser reads whole
        answers instead and has its own)."""
        self._buffer += text
        deltas: list[dict[str, Any]] = []
        out: list[str] = []
        while self._step(out, deltas):
            pass
        joined = "".join(out)
        self.content += joined
        return joined, deltas

    def _step(self, out: list[str], deltas: list[dict[str, Any]]) -> bool:
        """One move of the state machine; False when it needs more text."""
        raise NotImplementedError

    def tool_calls(self) -> list[dict[str, Any]]:
        return [
            {"id": c["id"], "type": "function", "function": dict(c["function"])} for c in self.calls
        ]

    def _open(self, name: str, deltas: list[dict[str, Any]]) -> None:
        index = len(self.calls)
        call_id = self.call_id(index)
        self.calls.append(
            {"id": call_id, "function": {"name": name, "arguments": ""}, "complete": False}
        )
        self._sent = 0
        deltas.append(
            {
                "index": index,
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
        )

    def _send(self, arguments: str, deltas: list[dict[str, Any]]) -> None:
        """The open call's arguments are now `arguments` (a longer prefix of them)."""
        if len(arguments) <= self._sent:
            return
        fragment = arguments[self._sent :]
        self._sent = len(arguments)
        self.calls[-1]["function"]["arguments"] += fragment
        deltas.append({"index": len(self.calls) - 1, "function": {"arguments": fragment}})

    def _arguments(self, deltas: list[dict[str, Any]]) -> bool:
        """Stream the open call's arguments from the buffer; True once they are complete
        (the buffer then holds what follows them)."""
        end = json_value_end(self._buffer)
        if end is None:
            self._send(self._buffer.rstrip(), deltas)  # trailing space may end the call
            return False
        self._send(self._buffer[:end], deltas)
        self.calls[-1]["complete"] = True
        self._buffer = self._buffer[end:]
        return True

    def _whole_call(self, text: str, arguments_key: str, deltas: list[dict[str, Any]]) -> bool:
        """A complete JSON object that is a call with its keys in another order."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return False
        if not (isinstance(value, dict) and isinstance(value.get("name"), str)):
            return False
        if arguments_key not in value:
            return False
        self._open(value["name"], deltas)
        self._send(json.dumps(value[arguments_key], ensure_ascii=False), deltas)
        self.calls[-1]["complete"] = True
        return True


class MarkedCallParser(JsonCallParser):
    """A format whose calls start at a marker (`OPENING`): content until it, then the
    subclass's `_step` state machine, which returns to "text" after the calls."""

    OPENING = ""

    def __init__(self, call_id: Callable[[int], str]) -> None:
        super().__init__(call_id)
        self._state = "text"
        self._after_calls = False  # the space after calls is not content

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """Held-back text is content, unless it is the marker's start; a call cut short
        stays as far as it was sent (not complete)."""
        out = ""
        if self._state == "text":
            held = self._buffer.strip()
            if held and not self.OPENING.startswith(held):
                out = self._buffer
        self.content += out
        self._buffer = ""
        return out, []

    def _step(self, out: list[str], deltas: list[dict[str, Any]]) -> bool:
        """One move of the state machine; False when it needs more text."""
        raise NotImplementedError

    def _text(self, out: list[str], after: str) -> bool:
        """Content up to the marker, then state `after` (True); False while it is not
        there, holding back what may be its start and the space before it."""
        buffer = self._buffer
        if self._after_calls:
            buffer = self._buffer = buffer.lstrip()
            self._after_calls = not buffer
        at = buffer.find(self.OPENING)
        if at < 0:
            cut = len(buffer) - partial_suffix(buffer, self.OPENING)
            while cut > 0 and buffer[cut - 1].isspace():
                cut -= 1  # space before a call is not content
            out.append(buffer[:cut])
            self._buffer = buffer[cut:]
            return False
        out.append(buffer[:at].rstrip())
        self._buffer, self._state = buffer[at + len(self.OPENING) :], after
        return True


class Llama3Parser(JsonCallParser):
    """Llama 3.x: the answer is a call when it is `{"name": ..., "parameters": ...}`
    (maybe after `<|python_tag|>`), else content; held back while it may still be a call."""

    def __init__(self, call_id: Callable[[int], str]) -> None:
        super().__init__(call_id)
        self._state = "start"  # start -> content | call -> after

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self._buffer += text
        deltas: list[dict[str, Any]] = []
        out = ""
        if self._state == "start":
            body = _after_tag(self._buffer)
            if body is None or not body.strip():
                return "", deltas  # only space, or the tag's start so far
            body = body.lstrip()
            head = _LLAMA_HEAD.match(body)
            if head is not None:
                self._open(json.loads(f'"{head.group(1)}"'), deltas)
                self._buffer, self._state = body[head.end() :], "call"
            elif body.startswith("{") and json_value_end(body) is None:
                return "", deltas  # a JSON object whose head is not known yet
            elif body.startswith("{") and self._whole_call(body, "parameters", deltas):
                self._buffer, self._state = "", "after"
            else:
                self._state = "content"
        if self._state == "content":
            out, self._buffer = self._buffer, ""
        elif self._state == "call" and self._arguments(deltas):
            self._state = "after"
        if self._state == "after":
            self._buffer = ""  # the call's closing brace; the answer is the call
        self.content += out
        return out, deltas

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        deltas: list[dict[str, Any]] = []
        out = ""
        if self._state == "start":
            body = _after_tag(self._buffer)
            if body is not None and body.strip():
                if not self._whole_call(body.strip(), "parameters", deltas):
                    out = self._buffer
            self.content += out
        self._buffer = ""
        return out, deltas


def _after_tag(text: str) -> str | None:
    """The text after a leading `<|python_tag|>`; None while it may still be that tag."""
    stripped = text.lstrip()
    if stripped.startswith(PYTHON_TAG):
        return stripped[len(PYTHON_TAG) :]
    if stripped and PYTHON_TAG.startswith(stripped):
        return None
    return text


class MistralParser(JsonCallParser):
    """Mistral: content until `[TOOL_CALLS]`, then its calls (a JSON list, or `NAME[ARGS]`
    and the arguments, per `args_form`)."""

    def __init__(self, call_id: Callable[[int], str], args_form: bool = False) -> None:
        super().__init__(call_id)
        self.args_form = args_form
        self._state = "text"  # text -> list -> item -> arguments -> item_end -> ... -> done
        self._after_call = False

    def _step(self, out: list[str], deltas: list[dict[str, Any]]) -> bool:
        """One move of the state machine; False when it needs more text."""
        state, buffer = self._state, self._buffer
        if state == "text":
            if self._after_call:  # the space between calls, or after them, is not content
                buffer = self._buffer = buffer.lstrip()
                self._after_call = not buffer
            at = buffer.find(TOOL_CALLS)
            if at < 0:
                keep = partial_suffix(buffer, TOOL_CALLS)
                cut = len(buffer) - keep
                while cut > 0 and buffer[cut - 1].isspace():
                    cut -= 1  # space before a call is not content
                out.append(buffer[:cut])
                self._buffer = buffer[cut:]
                return False
            out.append(buffer[:at].rstrip())
            self._buffer = buffer[at + len(TOOL_CALLS) :]
            self._state = "name" if self.args_form else "list"
            return True
        if state == "name":
            at = buffer.find(ARGS)
            if at < 0:
                return False
            self._open(buffer[:at].split(CALL_ID)[0].strip(), deltas)
            self._buffer, self._state = buffer[at + len(ARGS) :].lstrip(), "arguments"
            return True
        if state == "arguments":
            if not self._buffer or not self._arguments(deltas):
                return False
            self._state = "text" if self.args_form else "item_end"
            self._after_call = self.args_form
            return True
        if state == "item_end":  # what follows the arguments: `, "id": "..."}`
            at = buffer.find("}")
            if at < 0:
                return False
            self._buffer, self._state = buffer[at + 1 :], "item"
            return True
        body = buffer.lstrip()
        if not body or state == "done":
            self._buffer = "" if state == "done" else buffer
            return False
        if state == "list":
            self._buffer, self._state = body[1:], "item" if body[0] == "[" else "done"
            return True
        # state == "item": the next call, a separator, or the end of the list
        if body[0] in ",]":
            self._buffer, self._state = body[1:], "item" if body[0] == "," else "done"
            return True
        head = _MISTRAL_HEAD.match(body)
        if head is not None:
            self._open(json.loads(f'"{head.group(1)}"'), deltas)
            self._buffer, self._state = body[head.end() :], "arguments"
            return True
        end = json_value_end(body) if body[0] == "{" else 0
        if end is None:
            return False  # a call whose head is not known yet
        if end and self._whole_call(body[:end], "arguments", deltas):
            self._buffer = body[end:]
            return True
        self._state = "done"  # not a call: the list ends here
        return True

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        out = ""
        if self._state == "text":
            held = self._buffer.strip()
            if held and not TOOL_CALLS.startswith(held):
                out = self._buffer
        self.content += out
        self._buffer = ""
        return out, []


# ------------------------------------------------------------------ grammars


def json_call_grammar(
    fmt: ChatFormat,
    functions: Sequence[Mapping[str, Any]],
    auto: bool,
    more: bool,
) -> Constraint:
    """The Lark grammar holding a Llama 3.x or Mistral answer's calls valid: `auto` leaves
    the answer free unless it starts a call; `more` allows several calls (Mistral only:
    Llama 3.x's template renders one call a turn)."""
    arguments_key = "parameters" if fmt.family == "llama3" else "arguments"
    lines = []
    for i, function in enumerate(functions):
        schema = {**(function.get("parameters") or {"type": "object", "properties": {}})}
        schema.setdefault("x-guidance", JSON_FORMAT)
        name = json.dumps(function["name"])
        if fmt.family == "mistral" and fmt.args_form:
            args = fmt.grammar_literal(ARGS)
            lines.append(f"fn_{i}: {name} {args} %json {json.dumps(schema)}")
        else:
            head = json.dumps(f'{{"name": {name}, "{arguments_key}": ')
            lines.append(f'fn_{i}: {head} %json {json.dumps(schema)} "}}"')
    call = " | ".join(f"fn_{i}" for i in range(len(functions)))
    if fmt.family == "llama3":
        # a call is the whole answer; any other answer may not start with "{"
        start = "start: call | PLAIN\nPLAIN: /([^{](.|\\n)*)?/\n" if auto else "start: call\n"
    else:
        marker = fmt.grammar_literal(TOOL_CALLS)
        if fmt.args_form:
            calls = "call" + (f" ({marker} call)*" if more else "")
        else:
            calls = '"[" call' + (' (", " call)*' if more else "") + ' "]"'
        start = f"start: {marker} {calls}\n"
        if auto:
            start = f"start: TEXT | {text_then(fmt, TOOL_CALLS)} {calls}\nTEXT: /(.|\\n)*/\n"
            if not fmt.is_token(TOOL_CALLS):
                start += f"text_then_marker[lazy]: TEXT {marker}\n"
    return Constraint(GRAMMAR, start + f"call: {call}\n" + "\n".join(lines) + "\n", param="tools")


def text_then(fmt: ChatFormat, marker: str) -> str:
    """Free text ending where `marker` starts the calls: a marker that is one control token
    ends the text by itself (text cannot hold it); a textual one ends a lazy lexeme
    (`text_then_marker`, llguidance's trigger, as llama.cpp's lazy grammars)."""
    if fmt.is_token(marker):
        return f"TEXT {fmt.grammar_literal(marker)}"
    return "text_then_marker"
