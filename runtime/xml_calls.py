"""Tool calls written as XML by Qwen3-Coder, Qwen3.5 / 3.6, Nemotron Nano 3 and StepFun 3.5
(`qwen3_xml`): the parser and the grammar.

A call, as these templates render a past one (and llama.cpp's parsers/qwen3-coder.cpp reads):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A parameter's value is text, typed by the tool's JSON schema as llama.cpp types it: a
parameter that may only be a string stays the text; one that may not be a string is its JSON
(`3`, `true`, `{"a": 1}`); one that may be either is JSON where the text parses as a type it
allows, else the text. The parser gives OpenAI's deltas, as the others do: the call's id and
name once `<function=NAME>` is read, then its `arguments`, a JSON object built parameter by
parameter (a string's text streams as it comes; another value is sent when it ends).
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from runtime.constraints import GRAMMAR, JSON_FORMAT, Constraint
from runtime.json_calls import MarkedCallParser, json_type, partial_suffix

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_VALUE_END = "\n" + PARAMETER_END
_FUNCTION_HEAD = re.compile(r"<function=([^>\n]*)>")
_PARAMETER_HEAD = re.compile(r"<parameter=([^>\n]*)>(?=(.|\n))")
_MAX_PERMUTED = 4  # required parameters accepted in any order up to this many (4! = 24)


def schema_types(schema: Any) -> set[str] | None:
    """The JSON types a parameter's schema allows (`integer` as `number`); None where it
    does not say (then any)."""
    if not isinstance(schema, Mapping):
        return None
    kind = schema.get("type")
    if isinstance(kind, str):
        return {"number" if kind == "integer" else kind}
    if isinstance(kind, list):
        return {"number" if k == "integer" else str(k) for k in kind}
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(values, list):
        return {json_type(v) for v in values}
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            found: set[str] = set()
            for part in schema[key]:
                types = schema_types(part)
                if types is None:
                    return None
                found |= types
            return found
    return None


def typed_value(text: str, types: set[str] | None) -> str:
    """A parameter's text as the JSON its schema types it to: a string unless the schema
    allows another type the text parses as (Jinja writes Python's True / False for a
    boolean: read as JSON's)."""
    if types == {"string"}:
        return json.dumps(text, ensure_ascii=False)
    stripped = text.strip()
    if types is not None and "boolean" in types and stripped in ("True", "False"):
        stripped = stripped.lower()
    try:
        value = json.loads(stripped)
    except json.JSONDecodeError:
        return json.dumps(text, ensure_ascii=False)
    if types is not None and json_type(value) not in types:
        return json.dumps(text, ensure_ascii=False)
    return json.dumps(value, ensure_ascii=False)


def _properties(function: Mapping[str, Any]) -> Mapping[str, Any]:
    parameters = function.get("parameters") or {}
    properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
    return properties if isinstance(properties, Mapping) else {}


class XmlCallParser(MarkedCallParser):
    """Qwen3-Coder's XML calls: content until `<tool_call>`, then `<function=NAME>` and its
    `<parameter=KEY>` blocks; a call's `arguments` is the JSON object of its parameters,
    typed by `tools` (OpenAI function tools; None: each value is JSON where it parses)."""

    OPENING = OPEN

    def __init__(
        self, call_id: Callable[[int], str], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> None:
        super().__init__(call_id)
        self._types = {
            t["function"]["name"]: {
                k: schema_types(v) for k, v in _properties(t["function"]).items()
            }
            for t in tools or []
            if isinstance(t.get("function"), Mapping) and "name" in t["function"]
        }
        # states: text -> call -> params -> value -> params ... -> after -> text
        self._arguments_text = ""  # the open call's arguments so far (a prefix of its JSON)
        self._parameter: tuple[str, set[str] | None] = ("", None)  # the open one's name, types

    def _step(self, out: list[str], deltas: list[dict[str, Any]]) -> bool:
        """One move of the state machine; False when it needs more text."""
        state = self._state
        if state == "text":
            return self._text(out, "call")
        if state == "value":
            return self._value(deltas)
        buffer = self._buffer = self._buffer.lstrip()
        if not buffer:
            return False
        if state == "call":
            return self._function(buffer, deltas)
        if state == "params":
            return self._params(buffer, deltas)
        # state == "after": the call's </tool_call>
        if buffer.startswith(CLOSE):
            self._buffer, self._state, self._after_calls = buffer[len(CLOSE) :], "text", True
            return True
        if CLOSE.startswith(buffer):
            return False
        self._state = "text"  # no closing tag: what follows is text again
        return True

    def _function(self, buffer: str, deltas: list[dict[str, Any]]) -> bool:
        head = _FUNCTION_HEAD.match(buffer)
        if head is not None:
            self._open(head.group(1).strip(), deltas)
            self._arguments_text = "{"
            self._buffer, self._state = buffer[head.end() :], "params"
            return True
        if FUNCTION.startswith(buffer) or (buffer.startswith(FUNCTION) and ">" not in buffer):
            return False
        at = buffer.find(CLOSE)  # not a call: dropped up to its end
        if at < 0:
            return False
        self._buffer, self._state, self._after_calls = buffer[at + len(CLOSE) :], "text", True
        return True

    def _params(self, buffer: str, deltas: list[dict[str, Any]]) -> bool:
        if buffer.startswith(FUNCTION_END):
            self._arguments_text += "}"
            self._send(self._arguments_text, deltas)
            self.calls[-1]["complete"] = True
            self._buffer, self._state = buffer[len(FUNCTION_END) :], "after"
            return True
        head = _PARAMETER_HEAD.match(buffer)
        if head is None:
            if any(tag.startswith(buffer) for tag in (FUNCTION_END, PARAMETER)):
                return False
            if buffer.startswith(PARAMETER) and ">" not in buffer:
                return False
            nxt = [at for at in (buffer.find(PARAMETER, 1), buffer.find(FUNCTION_END)) if at > 0]
            if not nxt:
                return False  # not a parameter: skipped up to the next tag
            self._buffer = buffer[min(nxt) :]
            return True
        name = head.group(1).strip()
        rest = buffer[head.end() :]
        self._buffer = rest[1:] if rest.startswith("\n") else rest
        types = self._types.get(self.calls[-1]["function"]["name"], {}).get(name)
        self._parameter = (name, types)
        separator = ", " if self._arguments_text != "{" else ""
        self._arguments_text += separator + json.dumps(name, ensure_ascii=False) + ": "
        if types == {"string"}:
            self._arguments_text += '"'
        self._send(self._arguments_text, deltas)  # the key now, the value as it comes
        self._state = "value"
        return True

    def _value(self, deltas: list[dict[str, Any]]) -> bool:
        buffer, types = self._buffer, self._parameter[1]
        at = buffer.find(PARAMETER_END)
        if at < 0:
            if types == {"string"}:  # stream the text, all but what may be the value's end
                held = max(
                    partial_suffix(buffer, _VALUE_END), partial_suffix(buffer, PARAMETER_END)
                )
                self._arguments_text += _escaped(buffer[: len(buffer) - held])
                self._send(self._arguments_text, deltas)
                self._buffer = buffer[len(buffer) - held :]
            return False
        text = buffer[:at].removesuffix("\n")
        if types == {"string"}:
            self._arguments_text += _escaped(text) + '"'
        else:
            self._arguments_text += typed_value(text, types)
        self._send(self._arguments_text, deltas)
        self._buffer, self._state = buffer[at + len(PARAMETER_END) :], "params"
        return True


def _escaped(text: str) -> str:
    """`text` inside a JSON string (a prefix's escape is a prefix of the whole's)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


# ------------------------------------------------------------------ grammar


def xml_call_grammar(functions: Sequence[Mapping[str, Any]], auto: bool, more: bool) -> Constraint:
    """The Lark grammar holding Qwen3-Coder XML calls valid, as llama.cpp's: each required
    parameter once (in any order, up to `_MAX_PERMUTED` of them; else in the schema's), then
    any optional ones; a value that may be a string is any text up to `\\n</parameter>\\n`,
    another the JSON its schema allows. `auto` leaves text free until `<tool_call>`; `more`
    allows further calls."""
    alternatives = " | ".join(f"fn_{i}" for i in range(len(functions)))
    # the templates differ in the newlines between and after calls
    calls = 'call ("\\n"? "<tool_call>" call)* "\\n"?' if more else 'call "\\n"?'
    if auto:
        start = f"start: TEXT | text_then_open {calls}\n"
        start += 'text_then_open[lazy]: TEXT "<tool_call>"\n'
    else:
        start = f'start: "<tool_call>" {calls}\n'
    lines = [
        start + "TEXT: /(.|\\n)*/",
        f'call: "\\n" ({alternatives}) "</tool_call>"',
        'string_value[lazy]: TEXT "\\n</parameter>\\n"',
    ]
    for i, function in enumerate(functions):
        lines += _function_rules(i, function)
    return Constraint(GRAMMAR, "\n".join(lines) + "\n", param="tools")


def _function_rules(i: int, function: Mapping[str, Any]) -> list[str]:
    parameters = function.get("parameters") or {}
    required = set(parameters.get("required") or []) if isinstance(parameters, Mapping) else set()
    lines, needed, optional = [], [], []
    for j, (key, schema) in enumerate(_properties(function).items()):
        head = json.dumps(f"<parameter={key}>\n")
        types = schema_types(schema)
        if types is None or "string" in types:
            lines.append(f"p_{i}_{j}: {head} string_value")
        else:
            value = f"%json {json.dumps({**schema, 'x-guidance': JSON_FORMAT})}"
            if "boolean" in types:  # Jinja writes a boolean as Python's True / False
                value = f'({value} | "True" | "False")'
            lines.append(f'p_{i}_{j}: {head} {value} "\\n</parameter>\\n"')
        (needed if key in required else optional).append(f"p_{i}_{j}")
    if len(needed) <= _MAX_PERMUTED:
        orders = [f"({' '.join(order)})" for order in itertools.permutations(needed)]
    else:
        orders = [" ".join(needed)]
    args = f"({' | '.join(orders)}) " if needed else ""
    if optional:
        args += f"({' | '.join(optional)})*"
    name = json.dumps(f"<function={function['name']}>\n")
    lines.append(f'fn_{i}: {name} {args} "</function>\\n"')
    return lines
