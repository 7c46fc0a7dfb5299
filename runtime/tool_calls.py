"""Tool calling: the tools a chat request offers, the prompt that shows them, the grammar
that keeps a call valid, and the parser that finds the calls in the generated text.

Hermes style by default (what Qwen 2.5 and the Hermes models are trained on and what small
models follow from instructions alone; Llama 3.x, Mistral, Qwen3-Coder / Qwen3.5, DeepSeek
and gpt-oss write theirs in their own formats: `runtime.chat_formats`, `runtime.json_calls`,
`runtime.xml_calls`, `runtime.deepseek_calls`, `runtime.harmony`): a call is

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

- Prompt (`chat_for_template`): a template that uses `tools` renders them itself; for one
  that does not (SmolLM2's plain ChatML), the fallback appends to the system message a
  `<tools>` list and the instruction to answer with `<tool_call>` blocks, renders past
  assistant calls as those blocks, and turns `tool` messages into a user turn of
  `<tool_response>` blocks. DeepSeek's templates write past calls and results in their own
  markers but not the tools: those, and the call syntax, join the system message
  (`runtime.deepseek_calls.tools_intro`).
- Grammar (`tool_grammar`, an llguidance Lark grammar): `required` makes the whole answer
  one call (several with `parallel_tool_calls`), a named function exactly one call of it
  (small models asked for one call and allowed more tend to repeat it until `max_tokens`,
  so a forced function is one call, as most clients expect); `auto` leaves text free
  until the model writes `<tool_call>` (a lazy lexeme: llguidance's trigger, like llama.cpp's
  lazy grammars) and then holds the rest of the call to a valid call of one of the tools.
  The arguments follow the function's `parameters` schema (`%json`).
- Parser (`ToolCallParser`): fed the text as it is generated, it gives the content and the
  OpenAI tool-call deltas; the worker uses it for both the stream and the final body, so
  they agree. Text that could be the start of `<tool_call>` is held back until it is known.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from runtime.chat_formats import (
    DEEPSEEK_R1,
    DEEPSEEK_V3_1,
    HARMONY,
    HERMES,
    LLAMA3,
    MISTRAL,
    QWEN3_XML,
    ChatFormat,
)
from runtime.constraints import GRAMMAR, JSON_FORMAT, Constraint
from runtime.deepseek_calls import deepseek_grammar, tools_intro
from runtime.errors import InvalidSamplingParams
from runtime.harmony import harmony_grammar
from runtime.json_calls import json_call_grammar, partial_suffix
from runtime.xml_calls import xml_call_grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"
AUTO, NONE, REQUIRED = "auto", "none", "required"
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
MAX_TOOLS = 128  # OpenAI's limit
EMPTY_PARAMETERS = {"type": "object", "properties": {}}

# The fallback's instructions (for templates that do not render tools themselves).
FALLBACK_INTRO = (
    "You can call functions to help answer the user. The functions you may call are listed "
    "in <tools></tools>, one JSON signature per line:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with a JSON object holding its name and its arguments "
    "inside <tool_call></tool_call> tags, like this:\n"
    '<tool_call>\n{{"name": "function_name", "arguments": {{"argument": "value"}}}}\n'
    "</tool_call>\nDo not guess argument values the user did not give."
)


# ------------------------------------------------------------------ the request's tools


def check_tools(tools: Any, tool_choice: Any, parallel: Any) -> None:
    """Raise `InvalidSamplingParams` naming the field unless `tools` is a list of OpenAI
    function tools with distinct valid names, `tool_choice` is auto, none, required or a
    named function among them, and `parallel` a bool. Checked for a request and again for
    a record read back from Redis."""
    if tools is not None:
        if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
            raise InvalidSamplingParams(
                f"tools must be a list of at most {MAX_TOOLS} function tools.", param="tools"
            )
        names = [_tool_name(tool, i) for i, tool in enumerate(tools)]
        if len(set(names)) != len(names):
            raise InvalidSamplingParams("tools must have distinct function names.", param="tools")
    if not isinstance(parallel, bool):
        raise InvalidSamplingParams("parallel_tool_calls must be a boolean.", param="tools")
    if tool_choice in (None, AUTO, NONE, REQUIRED):
        if tool_choice == REQUIRED and not tools:
            raise InvalidSamplingParams(
                "tool_choice 'required' needs at least one tool in tools.", param="tool_choice"
            )
        return
    name = named_choice(tool_choice)
    if name is None:
        raise InvalidSamplingParams(
            "tool_choice must be 'auto', 'none', 'required' or "
            '{"type": "function", "function": {"name": ...}}.',
            param="tool_choice",
        )
    if name not in {tool["function"]["name"] for tool in tools or []}:
        raise InvalidSamplingParams(
            f"tool_choice names function {name!r}, which is not in tools.", param="tool_choice"
        )


def _tool_name(tool: Any, i: int) -> str:
    function = tool.get("function") if isinstance(tool, Mapping) else None
    if (
        not isinstance(tool, Mapping)
        or tool.get("type") != "function"
        or not isinstance(function, Mapping)
    ):
        raise InvalidSamplingParams(
            f'tools[{i}] must be {{"type": "function", "function": {{...}}}}.', param="tools"
        )
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.match(name):
        raise InvalidSamplingParams(
            f"tools[{i}].function.name must be 1 to 64 letters, digits, _ or -, got {name!r}.",
            param="tools",
        )
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, Mapping):
        raise InvalidSamplingParams(
            f"tools[{i}].function.parameters must be a JSON schema object.", param="tools"
        )
    return name


def named_choice(tool_choice: Any) -> str | None:
    """The function a `{"type": "function", "function": {"name"}}` choice names, else None."""
    if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            return function["name"]
    return None


def calls_possible(tools: Any, tool_choice: Any) -> bool:
    """Whether the answer may hold tool calls (and so is parsed for them)."""
    return bool(tools) and tool_choice != NONE


# ------------------------------------------------------------------ grammar


def tool_grammar(
    tools: Sequence[Mapping[str, Any]],
    tool_choice: Any,
    parallel: bool,
    fmt: ChatFormat | None = None,
    thinking: bool = False,
):
    """The `Constraint` (a Lark grammar) that keeps calls valid in the model's format
    (`fmt`, Hermes when None); None for `none` or no tools. Not yet compiled:
    `validate_constraint` (the API, at submission) and the generator do. `thinking`: the
    prompt leaves the answer inside a `<think>` block (Qwen3.5, R1), which a forced call
    may only follow (`auto`'s free text holds it already)."""
    if not calls_possible(tools, tool_choice):
        return None
    constraint = _calls_grammar(tools, tool_choice, parallel, fmt)
    if not thinking or tool_choice in (None, AUTO) or (fmt and fmt.family == HARMONY):
        return constraint
    assert constraint.value.startswith("start:")
    rules = constraint.value.replace("start:", "answer:", 1)
    head = 'start: thought "\\n"* answer\nthought[lazy]: THOUGHT "</think>"\nTHOUGHT: /(.|\\n)*/\n'
    return Constraint(GRAMMAR, head + rules, param="tools")


def _calls_grammar(
    tools: Sequence[Mapping[str, Any]], tool_choice: Any, parallel: bool, fmt: ChatFormat | None
) -> Constraint:
    name = named_choice(tool_choice)
    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    auto = tool_choice in (None, AUTO)
    if fmt is not None and fmt.family == HARMONY:
        return harmony_grammar(fmt, functions, auto)
    if fmt is not None and fmt.family in (LLAMA3, MISTRAL):
        return json_call_grammar(fmt, functions, auto, parallel and name is None)
    if fmt is not None and fmt.family == QWEN3_XML:
        return xml_call_grammar(functions, auto, parallel and name is None)
    if fmt is not None and fmt.family in (DEEPSEEK_R1, DEEPSEEK_V3_1):
        return deepseek_grammar(fmt, functions, auto, parallel and name is None)
    alternatives = " | ".join(f"fn_{i}" for i in range(len(functions)))
    # a named function is called once; otherwise `parallel` allows more calls in a row
    more = ' ("\\n" "<tool_call>" call)*' if parallel and name is None else ""
    if auto:
        # free text until the model writes <tool_call> (lazy: the trigger ends the text)
        start = f"start: TEXT | text_then_open call{more}\n"
        start += 'text_then_open[lazy]: TEXT "<tool_call>"\nTEXT: /(.|\\n)*/\n'
    else:
        start = f'start: "<tool_call>" call{more}\n'
    lines = [start, f'call: "\\n" ({alternatives}) "\\n</tool_call>"']
    for i, function in enumerate(functions):
        schema = {**(function.get("parameters") or EMPTY_PARAMETERS)}
        schema.setdefault("x-guidance", JSON_FORMAT)  # one line, fixed separators
        head = json.dumps(f'{{"name": {json.dumps(function["name"])}, "arguments": ')
        lines.append(f"fn_{i}: {head} %json {json.dumps(schema)} " + '"}"')
    return Constraint(GRAMMAR, "\n".join(lines) + "\n", param="tools")


# ------------------------------------------------------------------ prompt


def chat_for_template(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    native: bool,
    fmt: ChatFormat | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and extra template variables to render: as they are, with `tools=`, for
    a template that uses `tools` (`native`); else the Hermes-style fallback, but for
    DeepSeek's templates, which render past calls and results themselves: only the tools
    and their syntax join the system message. gpt-oss's template (`fmt` harmony) reads a
    turn's thinking from `thinking`, not `reasoning_content`."""
    family = fmt.family if fmt is not None else HERMES
    if native:
        extra = {"tools": list(tools)} if tools else {}
        out = [_native_message(m) for m in messages]
        return [_harmony_message(m) for m in out] if family == HARMONY else out, extra
    if fmt is not None and family in (DEEPSEEK_R1, DEEPSEEK_V3_1):
        out = [dict(m) if fmt.string_arguments else _native_message(m) for m in messages]
        return (_with_intro(out, tools_intro(fmt, tools)) if tools else out), {}
    return fallback_messages(messages, tools), {}


def _harmony_message(message: dict[str, Any]) -> dict[str, Any]:
    """As llama.cpp's gpt-oss path: the thinking goes to `thinking`, and a turn's content is
    a string, empty in a turn with calls and thinking (the template refuses both)."""
    if message.get("role") != "assistant":
        return message
    out = {**message}
    if out.get("content") is None:
        out["content"] = ""  # the template tests for text in it
    thinking = message.get("reasoning_content")
    if isinstance(thinking, str):
        out["thinking"] = thinking
        if message.get("tool_calls"):
            out["content"] = ""
    return out


def _native_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """Templates that render tool calls expect `arguments` as an object (transformers')."""
    if not message.get("tool_calls"):
        return dict(message)
    calls = []
    for call in message["tool_calls"]:
        function = dict(call.get("function") or {})
        function["arguments"] = _arguments_object(function.get("arguments"))
        calls.append({**call, "function": function})
    return {**message, "tool_calls": calls}


def fallback_messages(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, Any]]:
    """Messages for a template that knows nothing of tools: the tool list joins the system
    message, past calls become `<tool_call>` blocks, tool results `<tool_response>` blocks
    in a user turn (consecutive results share one turn)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        if role == "tool":
            block = f"<tool_response>\n{_text(message.get('content'))}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        elif role == "assistant" and message.get("tool_calls"):
            blocks = [_call_block(call) for call in message["tool_calls"]]
            text = _text(message.get("content")).strip()
            content = "\n".join(([text] if text else []) + blocks)
            rest = {k: v for k, v in message.items() if k != "tool_calls"}
            out.append(rest | {"content": content})
        else:
            out.append(dict(message))
    for message in out:
        message.pop("_tool_results", None)
    if tools:
        intro = FALLBACK_INTRO.format(
            tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        )
        out = _with_intro(out, intro)
    return out


def _with_intro(messages: list[dict[str, Any]], intro: str) -> list[dict[str, Any]]:
    """`intro` after the system message's text, or as the system message."""
    out = list(messages)
    if out and out[0].get("role") in ("system", "developer"):
        out[0] = {**out[0], "content": f"{_text(out[0].get('content'))}\n\n{intro}".strip()}
    else:
        out.insert(0, {"role": "system", "content": intro})
    return out


def _call_block(call: Mapping[str, Any]) -> str:
    function = call.get("function") or {}
    body = {"name": function.get("name"), "arguments": _arguments_object(function.get("arguments"))}
    return f"{OPEN}\n{json.dumps(body, ensure_ascii=False)}\n{CLOSE}"


def _arguments_object(arguments: Any) -> Any:
    """OpenAI sends a call's arguments as a JSON string; shown to the model as the object
    (a string that is not JSON stays a string)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # text parts
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return str(content)


# ------------------------------------------------------------------ parser

# a call's start up to its arguments' first character: then its name is known
_HEAD = re.compile(r'^\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')


class ToolCallParser:
    """Splits one choice's generated text into content and tool calls, incrementally.

    `feed(text)` takes the next piece and returns what may be shown now: a content delta and
    OpenAI tool-call deltas (`{"index", "id", "type", "function": {"name", "arguments": ""}}`
    when a call's name is known, then `{"index", "function": {"arguments": fragment}}`).
    `finish()` releases what was held back at the end. Held back: text that could start
    `<tool_call>` (and the whitespace before it), and in a call the end that could be the
    call's closing `}` and `</tool_call>`. The fragments of a call join into its final
    `arguments`, exactly the JSON the model wrote. `call_id(k)` names the k-th call (the
    worker makes it stable across a resumed job).

    The first call streams as it is written; a later one (parallel calls) is shown whole,
    in one delta, once it is complete, because it may yet be dropped: a call that repeats
    an earlier one of the answer (same function, same arguments) is dropped and ends the
    calls (`repeated`: small models, once allowed a second call, tend to repeat their calls
    until `max_tokens`), and a later call cut short by the end of the text is dropped.
    """

    def __init__(self, call_id: Callable[[int], str]) -> None:
        self.call_id = call_id
        self.content = ""
        self.calls: list[dict[str, Any]] = []
        self.repeated = False  # a call repeated an earlier one: the answer's calls are done
        self._buffer = ""
        self._in_call = False
        self._sent_arguments = 0  # characters of the open call's arguments already sent

    @property
    def complete(self) -> bool:
        """Every call it reports is complete (a first call may be cut short)."""
        return all(call["complete"] for call in self.calls)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self.repeated:
            return "", []  # the answer ended at the repeat; what follows is not shown
        self._buffer += text
        content: list[str] = []
        deltas: list[dict[str, Any]] = []
        while True:
            if not self._in_call:
                at = self._buffer.find(OPEN)
                if at < 0:
                    content.append(self._release_text())
                    break
                content.append(self._buffer[:at].rstrip())
                self._buffer = self._buffer[at + len(OPEN) :]
                self._in_call = True
                continue
            if not self._open_call(deltas):
                end = self._buffer.find(CLOSE)
                if end < 0:
                    break
                self._buffer = self._buffer[end + len(CLOSE) :]  # not a call: dropped
                self._in_call = False
                continue
            end = self._buffer.find(CLOSE)
            if end < 0:
                self._send_arguments(self._safe_arguments(), deltas)
                break
            self._send_arguments(_final_arguments(self._buffer[:end]), deltas)
            self._buffer = self._buffer[end + len(CLOSE) :].lstrip()
            self._in_call = False
            if not self._close_call(deltas):
                self._buffer = ""
                break
        text_out = "".join(content)
        self.content += text_out
        return text_out, deltas

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The end of the text: held-back text is content (unless it is the start of a tag,
        or whitespace after calls); a first call cut short keeps the arguments written so
        far, a later one is dropped; a call cut before its name is dropped."""
        deltas: list[dict[str, Any]] = []
        text = ""
        if self.repeated:  # everything after the repeat was dropped as it came
            return text, deltas
        if not self._in_call:
            held = self._buffer.strip()
            if held:  # the start of a tag, cut short, is not content
                text = "" if OPEN.startswith(held) else self._buffer
            else:  # whitespace ends a plain answer, or follows calls (then dropped)
                text = "" if self.calls else self._buffer
            self.content += text
        elif self.calls and not self.calls[-1]["complete"]:
            if len(self.calls) > 1:
                self.calls.pop()  # never shown: nothing to take back
            else:
                rest = self._buffer[: len(self._buffer) - partial_suffix(self._buffer, CLOSE)]
                self._send_arguments(rest.rstrip(), deltas)
        self._buffer = ""
        self._in_call = False
        return text, deltas

    def tool_calls(self) -> list[dict[str, Any]]:
        """The calls in OpenAI's message shape."""
        return [
            {"id": c["id"], "type": "function", "function": dict(c["function"])} for c in self.calls
        ]

    def _release_text(self) -> str:
        keep = partial_suffix(self._buffer, OPEN)
        cut = len(self._buffer) - keep
        while cut > 0 and self._buffer[cut - 1].isspace():
            cut -= 1  # whitespace before a call is not content
        out, self._buffer = self._buffer[:cut], self._buffer[cut:]
        return out

    def _open_call(self, deltas: list[dict[str, Any]]) -> bool:
        """Start the call once its name is known; False while it is not."""
        if self.calls and not self.calls[-1]["complete"]:
            return True
        match = _HEAD.match(self._buffer)
        if match is None:
            return False
        name = json.loads(f'"{match.group(1)}"')
        index = len(self.calls)
        call_id = self.call_id(index)
        self.calls.append(
            {"id": call_id, "function": {"name": name, "arguments": ""}, "complete": False}
        )
        self._buffer = self._buffer[match.end() :]
        self._sent_arguments = 0
        if index == 0:  # a later call is shown when it is complete (`_close_call`)
            deltas.append(_head_delta(index, call_id, name))
        return True

    def _close_call(self, deltas: list[dict[str, Any]]) -> bool:
        """The open call is complete: a later call is shown now, whole, unless it repeats
        an earlier one (then it is dropped and the calls are done: False)."""
        call = self.calls[-1]
        call["complete"] = True
        index = len(self.calls) - 1
        if index == 0:
            return True
        if any(_same_call(call, earlier) for earlier in self.calls[:-1]):
            self.calls.pop()
            self.repeated = True
            return False
        function = call["function"]
        delta = _head_delta(index, call["id"], function["name"])
        delta["function"]["arguments"] = function["arguments"]
        deltas.append(delta)
        return True

    def _safe_arguments(self) -> str:
        """The open call's arguments that cannot turn out to be its closing part."""
        text = self._buffer[: len(self._buffer) - partial_suffix(self._buffer, CLOSE)].rstrip()
        if text.endswith("}"):
            text = text[:-1].rstrip()  # maybe the call's own closing brace
        return text

    def _send_arguments(self, arguments: str, deltas: list[dict[str, Any]]) -> None:
        call = self.calls[-1]
        if len(arguments) <= self._sent_arguments:
            return
        fragment = arguments[self._sent_arguments :]
        self._sent_arguments = len(arguments)
        call["function"]["arguments"] += fragment
        if len(self.calls) == 1:
            deltas.append({"index": 0, "function": {"arguments": fragment}})


def _head_delta(index: int, call_id: str, name: str) -> dict[str, Any]:
    return {
        "index": index,
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": ""},
    }


def _same_call(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Same function with the same arguments, as JSON values (spacing and key order aside)."""
    if a["function"]["name"] != b["function"]["name"]:
        return False
    try:
        return json.loads(a["function"]["arguments"]) == json.loads(b["function"]["arguments"])
    except json.JSONDecodeError:
        return a["function"]["arguments"] == b["function"]["arguments"]


def _final_arguments(body: str) -> str:
    """A complete call's arguments: its text without the call's closing brace."""
    text = body.rstrip()
    return text[:-1].rstrip() if text.endswith("}") else text
