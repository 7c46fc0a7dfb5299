"""One chat answer split into thinking, content and tool calls, in its model's format.

`answer_parser` picks the parsers for a model's `ChatFormat` (`runtime.chat_formats`): a
leading `<think>` block (`runtime.reasoning`) and then the family's tool calls (Hermes,
Llama 3.x, Mistral, Qwen3-Coder's XML, DeepSeek), or gpt-oss's harmony messages, which carry both.
Each is fed the text as it is generated and returns (reasoning, content, tool-call deltas);
the worker builds the stream's deltas and the final message from the same parser, so the
two agree.
`reasoning_tokens` counts the generated tokens that fall inside thinking.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from runtime.chat_formats import (
    DEEPSEEK_R1,
    DEEPSEEK_V3_1,
    HARMONY,
    LLAMA3,
    MISTRAL,
    QWEN3_XML,
    ChatFormat,
)
from runtime.deepseek_calls import DeepSeekParser
from runtime.harmony import HarmonyParser
from runtime.json_calls import Llama3Parser, MistralParser
from runtime.reasoning import ReasoningParser
from runtime.tool_calls import ToolCallParser
from runtime.xml_calls import XmlCallParser

Deltas = list[dict[str, Any]]


class CallParser(Protocol):
    content: str
    repeated: bool

    @property
    def complete(self) -> bool: ...
    def feed(self, text: str) -> tuple[str, Deltas]: ...
    def finish(self) -> tuple[str, Deltas]: ...
    def tool_calls(self) -> list[dict[str, Any]]: ...


class AnswerParser:
    """Thinking first (when the model thinks), then content and calls (when calls may come)."""

    def __init__(self, reasoning: ReasoningParser | None, calls: CallParser | None) -> None:
        self.thinking = reasoning
        self.calls = calls

    @property
    def thinks(self) -> bool:
        """Whether the answer is parsed for thinking (its model thinks)."""
        return self.thinking is not None

    @property
    def reasoning(self) -> str | None:
        return self.thinking.reasoning if self.thinking is not None else None

    @property
    def reasoning_spans(self) -> list[list[int | None]]:
        return self.thinking.reasoning_spans if self.thinking is not None else []

    @property
    def content(self) -> str:
        if self.calls is not None:
            return self.calls.content
        return self.thinking.content if self.thinking is not None else ""

    @property
    def complete(self) -> bool:
        return self.calls is None or self.calls.complete

    @property
    def repeated(self) -> bool:
        """The answer repeated one of its calls (Hermes): it ends there."""
        return self.calls is not None and self.calls.repeated

    def tool_calls(self) -> list[dict[str, Any]]:
        return self.calls.tool_calls() if self.calls is not None else []

    def feed(self, text: str) -> tuple[str, str, Deltas]:
        reasoning, content = "", text
        if self.thinking is not None:
            reasoning, content = self.thinking.feed(text)
        calls: Deltas = []
        if self.calls is not None:
            content, calls = self.calls.feed(content)
        return reasoning, content, calls

    def finish(self) -> tuple[str, str, Deltas]:
        reasoning, content = "", ""
        if self.thinking is not None:
            reasoning, content = self.thinking.finish()
        calls: Deltas = []
        if self.calls is not None:
            content, calls = self.calls.feed(content)
            rest, more = self.calls.finish()
            content, calls = content + rest, calls + more
        return reasoning, content, calls


def answer_parser(
    fmt: ChatFormat,
    call_id: Callable[[int], str],
    calls: bool,
    thinking: bool | None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> AnswerParser | HarmonyParser | None:
    """The parser of one choice's answer: None where the text is the content as it is.
    `calls`: the request may make tool calls; `thinking`: None where the model does not
    think in `<think>` blocks, else whether the prompt leaves the answer inside one;
    `tools`: the request's, whose schemas type the values of XML calls (`qwen3_xml`)."""
    if fmt.family == HARMONY:
        return HarmonyParser(call_id, calls=calls)
    call_parser: CallParser | None = None
    if calls and fmt.family == LLAMA3:
        call_parser = Llama3Parser(call_id)
    elif calls and fmt.family == MISTRAL:
        call_parser = MistralParser(call_id, args_form=fmt.args_form)
    elif calls and fmt.family == QWEN3_XML:
        call_parser = XmlCallParser(call_id, tools)
    elif calls and fmt.family in (DEEPSEEK_R1, DEEPSEEK_V3_1):
        call_parser = DeepSeekParser(call_id, r1=fmt.family == DEEPSEEK_R1)
    elif calls:
        call_parser = ToolCallParser(call_id)
    reasoning = ReasoningParser(inside=thinking) if thinking is not None else None
    if call_parser is None and reasoning is None:
        return None
    return AnswerParser(reasoning, call_parser)


def reasoning_tokens(
    token_spans: Sequence[tuple[int, int]], reasoning_spans: Sequence[Sequence[int | None]]
) -> int:
    """Tokens (each a [start, end) of the text fed) inside a thinking span (tags included;
    one still open runs to the end); a token of no text counts where it stands."""
    count = 0
    for a, b in token_spans:
        for start, end in reasoning_spans:
            assert start is not None
            stop = end if end is not None else float("inf")
            if max(a, start) < min(b, stop) or (a == b and start <= a < stop):
                count += 1
                break
    return count
