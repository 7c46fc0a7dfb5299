"""Reasoning models' thinking, kept out of the answer.

Qwen3, QwQ, the DeepSeek-R1 distills and SmolLM3 write their thinking between `<think>` and
`</think>` before the answer; an R1 distill's template even opens the block itself (its
generation prompt ends with `<think>\\n`), so the text generated starts inside it. As
llama.cpp's server does with `--reasoning-format deepseek`, a block at the start of the
answer is returned apart (`reasoning_content` in chat, a reasoning item in Responses) and
never inside the content; a `<think>` later in the text is content like any other.
`ReasoningParser` is fed the text as it is generated, the way `runtime.tool_calls`'s parser
is, and holds back only what could still be a tag.
"""

from __future__ import annotations

from runtime.json_calls import partial_suffix

OPEN, CLOSE = "<think>", "</think>"


def thinks(chat_template: str | None) -> bool:
    """Whether a model's chat template speaks of thinking blocks at all."""
    return bool(chat_template) and CLOSE in chat_template


def opens_inside(prompt_text: str) -> bool:
    """Whether the rendered prompt leaves the answer inside an open `<think>` block."""
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN)


class ReasoningParser:
    """Splits one answer into its leading thinking and the content after it.

    `feed(text)` returns the (reasoning, content) the text shows now; `finish()` what was
    held back at the end. `reasoning` is None until the answer turns out to think. The
    whitespace after each tag is dropped (as llama.cpp's parser consumes it), so the split
    is the same however the text arrives. `reasoning_spans` holds the block's [start, end)
    character offsets in the text fed, tags included (end None while it is open), for
    counting thinking tokens.
    """

    def __init__(self, inside: bool = False) -> None:
        self.reasoning: str | None = "" if inside else None
        self.content = ""
        self.reasoning_spans: list[list[int | None]] = [[0, None]] if inside else []
        self._fed = 0  # characters fed so far
        # start -> (think_lead -> thinking ->) answer_lead -> answer; *_lead skip whitespace
        self._state = "think_lead" if inside else "start"
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        self._fed += len(text)
        reasoning, content = "", ""
        while self._held:
            state, held = self._state, self._held
            if state == "start":
                stripped = held.lstrip()
                if stripped.startswith(OPEN):
                    self.reasoning_spans.append([self._fed - len(stripped), None])
                    self._held, self._state, self.reasoning = (
                        stripped[len(OPEN) :],
                        "think_lead",
                        "",
                    )
                elif OPEN.startswith(stripped):
                    break  # could still be the opening tag
                else:
                    self._state = "answer"
            elif state in ("think_lead", "answer_lead"):
                self._held = held.lstrip()
                if self._held:
                    self._state = "thinking" if state == "think_lead" else "answer"
            elif state == "thinking":
                end = held.find(CLOSE)
                if end < 0:
                    cut = len(held) - partial_suffix(held, CLOSE)
                    reasoning, self._held = reasoning + held[:cut], held[cut:]
                    break
                reasoning += held[:end]
                self.reasoning_spans[-1][1] = self._fed - len(held) + end + len(CLOSE)
                self._held, self._state = held[end + len(CLOSE) :], "answer_lead"
            else:
                content, self._held = content + held, ""
        self._add(reasoning, content)
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back: an unfinished opening tag is content, an unfinished closing
        one still thinking (a block cut short by max_tokens stays reasoning)."""
        held, self._held = self._held, ""
        if self._state in ("thinking", "think_lead"):
            self._add(held, "")
            return held, ""
        if self._state == "answer_lead":
            return "", ""  # only the whitespace after the block
        self._add("", held)
        return "", held

    def _add(self, reasoning: str, content: str) -> None:
        if reasoning:
            self.reasoning = (self.reasoning or "") + reasoning
        self.content += content
