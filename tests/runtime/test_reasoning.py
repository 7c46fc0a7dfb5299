"""Splitting a thinking model's answer into its thinking and its content, piece by piece."""

from __future__ import annotations

import pytest

from runtime.reasoning import ReasoningParser, opens_inside, thinks

ANSWER = "<think>\nfirst, the sum: 2 + 2 = 4\n</think>\n\nIt is 4."


def _fed(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    reasoning, content = "", ""
    for piece in pieces:
        r, c = parser.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 100])
def test_thinking_and_content_come_apart_however_the_text_is_cut(size):
    pieces = [ANSWER[i : i + size] for i in range(0, len(ANSWER), size)]
    parser = ReasoningParser()
    assert _fed(parser, pieces) == ("first, the sum: 2 + 2 = 4\n", "It is 4.")
    assert parser.reasoning == "first, the sum: 2 + 2 = 4\n" and parser.content == "It is 4."


def test_a_prompt_that_opens_the_block_starts_inside_it():
    parser = ReasoningParser(inside=True)
    assert _fed(parser, ["4 it is", "</th", "ink>", "Four."]) == ("4 it is", "Four.")


def test_an_answer_that_does_not_think_is_all_content():
    parser = ReasoningParser()
    assert _fed(parser, ["<th", "is is not a tag", " <think>x</think>"]) == (
        "",
        "<this is not a tag <think>x</think>",
    )
    assert parser.reasoning is None


def test_thinking_cut_short_stays_thinking():
    assert _fed(ReasoningParser(), ["<think>half a thou", "ght </thi"]) == (
        "half a thought </thi",
        "",
    )


def test_what_templates_and_prompts_say():
    qwen3 = "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>{% endif %}"
    assert thinks(qwen3) and not thinks("{{ messages }}") and not thinks(None)
    assert opens_inside("<|Assistant|><think>\n") and not opens_inside("<|im_start|>assistant\n")
