"""One sequence's text as the engine assembles it from token ids: stop strings, split UTF-8,
and replaying the tokens an earlier run sent so the text continues exactly."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.detokenizer import TextAssembler
from runtime.engine import Engine
from tests.runtime.generation_helpers import engine_tokens


@pytest.fixture(scope="module")
def engine(tiny_llama_path: Path) -> Engine:
    return Engine.load(str(tiny_llama_path))


def assemble(assembler: TextAssembler, ids: list[int]) -> tuple[list[str], str | None]:
    texts, finish = [], None
    for i, token in enumerate(ids):
        text, finish = assembler.push(token, "length" if i == len(ids) - 1 else None)
        texts.append(text)
        if finish:
            break
    return texts, finish


def test_text_is_the_decoded_tokens_cut_at_the_first_stop_string(engine):
    ids = engine_tokens(engine, 60, seed=1)
    full = engine.tokenizer.decode(ids)
    texts, finish = assemble(TextAssembler(engine.tokenizer, []), ids)
    assert "".join(texts) == full and finish == "length"
    stop = full[20:23]
    texts, finish = assemble(TextAssembler(engine.tokenizer, [stop]), ids)
    assert "".join(texts) == full[: full.index(stop)] and finish == "stop"


@pytest.mark.parametrize("cut", [1, 7, 13, 30])
def test_replaying_sent_tokens_continues_the_text_exactly(engine, cut):
    """Split UTF-8 characters and half-matched stop strings survive the cut."""
    ids = engine_tokens(engine, 60, seed=2)
    stop = engine.tokenizer.decode(ids)[40:43]
    reference, finish = assemble(TextAssembler(engine.tokenizer, [stop]), ids)
    assert finish == "stop" and cut < len(reference)
    resumed = TextAssembler(engine.tokenizer, [stop])
    assert resumed.replay(ids[:cut]) == "".join(reference[:cut])
    assert assemble(resumed, ids[cut:]) == (reference[cut:], "stop")


def test_a_marker_releases_a_stop_strings_held_start_and_other_control_tokens_do_not(engine):
    """Token 1 is a control token (no text): as one of the request's markers it releases
    the "ab" a stop string "abc" held back, so a parser reads that text before the marker's;
    as any other control token it leaves it held, and "ab" + "c" after it still stops."""
    tokenizer = engine.tokenizer
    assert tokenizer.is_special(1)
    ab, c = tokenizer.encode("ab", add_special=False), tokenizer.encode("c", add_special=False)
    ids = ab + [1] + c
    marked, finish = assemble(TextAssembler(tokenizer, ["abc"], markers=[1]), ids)
    assert marked[len(ab) - 1 :] == ["", "ab", "c"] and finish == "length"
    plain, finish = assemble(TextAssembler(tokenizer, ["abc"]), ids)
    assert "".join(plain) == "" and finish == "stop"
    resumed = TextAssembler(tokenizer, ["abc"], markers=[1])
    assert resumed.replay(ids[: len(ab) + 1]) == "ab"
