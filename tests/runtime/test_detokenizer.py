"""IncrementalDetokenizer: whole characters only, and the same text as Tokenizer.decode."""

from __future__ import annotations

import pytest

from runtime.detokenizer import IncrementalDetokenizer
from runtime.tokenizer import Tokenizer
from tests.runtime.tokenizer_vocabs import gpt2_metadata, spm_metadata

MULTIBYTE = "🙂👍🏽 日本語の中文和한국어 👨‍👩‍👧 café 🫨"


def stream(tok: Tokenizer, ids: list[int], **kwargs) -> list[str]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    return [detok.push(i) for i in ids] + [detok.flush()]


def split_characters(tok: Tokenizer, ids: list[int]) -> int:
    """How many tokens end inside a UTF-8 character (so the test really exercises buffering)."""
    count, pending = 0, b""
    for i in ids:
        pending += tok.token_bytes(i)
        try:
            pending.decode("utf-8")
            pending = b""
        except UnicodeDecodeError:
            count += 1
    return count


def assert_streams_whole_characters(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special=False)
    assert split_characters(tok, ids) > 0
    chunks = stream(tok, ids)
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == tok.decode(ids) == text


def test_bytes_only_vocab_streams_whole_characters():
    # no merges: every multi-byte character arrives as 2-4 single-byte tokens
    assert_streams_whole_characters(Tokenizer.from_metadata(gpt2_metadata(merges=[])), MULTIBYTE)


def test_byte_fallback_streams_whole_characters():
    meta = spm_metadata(**{"tokenizer.ggml.add_space_prefix": False})
    assert_streams_whole_characters(Tokenizer.from_metadata(meta), "a🫨b日")


def test_output_waits_for_the_last_byte_of_a_character():
    tok = Tokenizer.from_metadata(gpt2_metadata(merges=[]))
    ids = tok.encode("🫨!")  # 4 byte tokens, then "!"
    assert stream(tok, ids) == ["", "", "", "🫨", "!", ""]


def test_flush_turns_an_unfinished_character_into_a_replacement_char():
    tok = Tokenizer.from_metadata(gpt2_metadata(merges=[]))
    first_two = tok.encode("日")[:2]
    detok = IncrementalDetokenizer(tok)
    assert [detok.push(i) for i in first_two] == ["", ""]
    assert detok.flush() == "\ufffd"
    assert detok.push(tok.encode("a")[0]) == "a"  # flush reset the buffer


def test_special_tokens_produce_no_text_unless_asked():
    tok = Tokenizer.from_metadata(gpt2_metadata())
    ids = tok.encode("hi<|endoftext|>")
    assert "".join(stream(tok, ids)) == "hi"
    assert "".join(stream(tok, ids, skip_special=False)) == "hi<|endoftext|>"


def test_prefix_space_is_kept_for_continuations_and_stripped_on_request():
    tok = Tokenizer.from_metadata(spm_metadata())  # add_space_prefix defaults to True
    ids = tok.encode("a b")  # <s> ▁a ▁ b
    assert "".join(stream(tok, ids)) == " a b"  # generated text continues a prompt
    assert "".join(stream(tok, ids, strip_prefix_space=True)) == tok.decode(ids) == "a b"


def test_smollm2_streams_emoji_and_cjk_whole(smollm2_tokenizer):
    assert_streams_whole_characters(smollm2_tokenizer, MULTIBYTE)


@pytest.mark.slow
def test_gemma3_streams_emoji_and_cjk_whole(gemma3_tokenizer):
    # 🫨 is not in Gemma's vocab: it comes out of byte fallback as four <0xNN> tokens
    assert_streams_whole_characters(gemma3_tokenizer, MULTIBYTE)
    ids = gemma3_tokenizer.encode("<start_of_turn>model\nhi 🫨<end_of_turn>", add_special=True)
    assert "".join(stream(gemma3_tokenizer, ids)) == gemma3_tokenizer.decode(ids) == "model\nhi 🫨"
