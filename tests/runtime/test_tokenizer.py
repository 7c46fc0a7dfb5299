"""Tokenizer: llama.cpp semantics on hand-made vocabularies, then on the real model vocabs.

The ids expected from the real models were produced by llama.cpp (llama-cpp-python 0.3.36,
`Llama(vocab_only=True).tokenize(text, add_bos=add_special, special=parse_special)`).
"""

from __future__ import annotations

import logging
import time

import pytest

from runtime import tokenizer_backends
from runtime.errors import InvalidTokenIdError, TokenizerError, UnsupportedTokenizerError
from runtime.tokenizer import Tokenizer
from tests.runtime.tokenizer_vocabs import (
    CONTROL,
    NORMAL,
    USER_DEFINED,
    gpt2_metadata,
    spm_metadata,
)


def ids_of(tok: Tokenizer, *texts: str) -> list[int]:
    """Ids of whole tokens given by their GGUF text."""
    index = {tok.token_text(i): i for i in range(tok.vocab_size)}
    return [index[t] for t in texts]


# ------------------------------------------------------------------ construction


@pytest.mark.parametrize("model", ["bert", "t5", "rwkv", None])
def test_unsupported_tokenizer_model_is_a_named_error(model):
    meta = gpt2_metadata()
    meta["tokenizer.ggml.model"] = model
    with pytest.raises(UnsupportedTokenizerError, match="tokenizer.ggml.model"):
        Tokenizer.from_metadata(meta)


def test_missing_vocab_and_merges_are_named_errors():
    with pytest.raises(TokenizerError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "gpt2"})
    meta = gpt2_metadata()
    del meta["tokenizer.ggml.merges"]
    with pytest.raises(TokenizerError, match="merges"):
        Tokenizer.from_metadata(meta)


def test_unknown_pre_tokenizer_falls_back_to_gpt2_with_a_warning(caplog):
    meta = gpt2_metadata(**{"tokenizer.ggml.pre": "no-such-pre"})
    with caplog.at_level(logging.WARNING, logger="runtime.tokenizer_backends"):
        tok = Tokenizer.from_metadata(meta)
    assert "no-such-pre" in caplog.text
    reference = Tokenizer.from_metadata(gpt2_metadata())
    text = "the tin 123 can't  go"
    assert tok.encode(text) == reference.encode(text)


# ------------------------------------------------------------------ byte-level BPE


def test_bpe_merges_by_rank_and_maps_bytes():
    tok = Tokenizer.from_metadata(gpt2_metadata())
    assert tok.encode("the") == ids_of(tok, "t", "he")  # no "t he" merge, only "Ġt he"
    assert tok.encode(" the") == ids_of(tok, "Ġthe")
    assert tok.encode(" tin") == ids_of(tok, "Ġt", "in")
    assert tok.token_bytes(ids_of(tok, "Ġthe")[0]) == b" the"


def pieces(pre: str, merges: list[str], text: str) -> list[str]:
    tok = Tokenizer.from_metadata(gpt2_metadata(merges=merges, **{"tokenizer.ggml.pre": pre}))
    return [tok.token_text(i) for i in tok.encode(text, add_special=False)]


@pytest.mark.parametrize(
    ("pre", "expected"),
    [
        ("gpt2", ["Ġ", "12", "34"]),  # " 1234" is one pre-token
        ("default", ["Ġ", "12", "3", "4"]),  # llama.cpp's default: digit runs cut by threes
        ("llama-bpe", ["Ġ", "12", "3", "4"]),  # \p{N}{1,3}
        ("qwen2", ["Ġ", "1", "2", "3", "4"]),  # one digit per pre-token
        ("smollm", ["Ġ", "1", "2", "3", "4"]),  # digits isolated first
    ],
)
def test_pre_tokenizers_group_digits_like_llama_cpp(pre, expected):
    assert pieces(pre, ["3 4", "1 2", "Ġ 1"], " 1234") == expected


def test_llama3_contractions_ignore_case_and_gpt2_ones_do_not():
    assert pieces("gpt2", ["' S"], "IT'S") == ["I", "T", "'", "S"]
    assert pieces("llama-bpe", ["' S"], "IT'S") == ["I", "T", "'S"]


def test_bpe_bos_defaults_follow_llama_cpp():
    assert Tokenizer.from_metadata(gpt2_metadata()).add_bos is False
    llama3 = Tokenizer.from_metadata(
        gpt2_metadata(
            specials={"<|begin_of_text|>": CONTROL},
            **{"tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.bos_token_id": 261},
        )
    )
    assert llama3.add_bos is True
    assert llama3.encode("a") == [261, ids_of(llama3, "a")[0]]
    assert llama3.encode("a", add_special=False) == ids_of(llama3, "a")


def test_add_bos_and_add_eos_come_from_metadata():
    meta = gpt2_metadata(
        specials={"<s>": CONTROL, "</s>": CONTROL},
        **{"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True},
    )
    meta["tokenizer.ggml.bos_token_id"] = meta["tokenizer.ggml.tokens"].index("<s>")
    meta["tokenizer.ggml.eos_token_id"] = meta["tokenizer.ggml.tokens"].index("</s>")
    tok = Tokenizer.from_metadata(meta)
    bos, eos = ids_of(tok, "<s>", "</s>")
    assert tok.encode("a") == [bos, *ids_of(tok, "a"), eos]
    assert tok.encode("a", add_special=False) == ids_of(tok, "a")
    assert tok.encode("") == [bos, eos]


def test_bos_required_but_undefined_is_a_named_error():
    tok = Tokenizer.from_metadata(gpt2_metadata(**{"tokenizer.ggml.add_bos_token": True}))
    with pytest.raises(TokenizerError, match="BOS"):
        tok.encode("a")


# ------------------------------------------------------------------ special tokens


def test_control_tokens_parse_only_with_parse_special():
    tok = Tokenizer.from_metadata(gpt2_metadata(specials={"<|im_start|>": CONTROL}))
    (special,) = ids_of(tok, "<|im_start|>")
    assert tok.encode("<|im_start|>a") == [special, *ids_of(tok, "a")]
    plain = tok.encode("<|im_start|>a", parse_special=False)
    assert special not in plain
    assert tok.decode(plain) == "<|im_start|>a"


def test_user_defined_tokens_are_always_atomic():
    tok = Tokenizer.from_metadata(gpt2_metadata(specials={"<tool>": USER_DEFINED}))
    (tool,) = ids_of(tok, "<tool>")
    for parse in (True, False):
        assert tok.encode("x<tool>y", parse_special=parse) == [
            *ids_of(tok, "x"),
            tool,
            *ids_of(tok, "y"),
        ]
    assert tok.token_bytes(tool) == b"<tool>"  # user-defined tokens stand for their text


def test_longer_special_tokens_are_cut_out_first_as_llama_cpp_does():
    # llama.cpp cuts the longest special everywhere before trying shorter ones, even when a
    # shorter one starts earlier: "<|a|><|b" -> "<|" + "a|><|b", not "<|a|>" + "<|b".
    tok = Tokenizer.from_metadata(
        gpt2_metadata(specials={"<|a|>": CONTROL, "a|><|b": USER_DEFINED})
    )
    short, long = ids_of(tok, "<|a|>", "a|><|b")
    ids = tok.encode("<|a|><|b")
    assert long in ids and short not in ids
    assert tok.encode("<|a|> <|a|>") == [short, *ids_of(tok, "Ġ"), short]


def test_end_of_turn_texts_become_control_and_stop_tokens():
    meta = gpt2_metadata(specials={"<|endoftext|>": CONTROL, "<|im_end|>": NORMAL, "<x>": CONTROL})
    meta["tokenizer.ggml.eot_token_id"] = meta["tokenizer.ggml.tokens"].index("<x>")
    tok = Tokenizer.from_metadata(meta)
    eos, im_end, x = ids_of(tok, "<|endoftext|>", "<|im_end|>", "<x>")
    assert tok.eos_id == eos
    assert tok.stop_ids == tok.eot_ids == {eos, im_end, x}
    assert tok.encode("<|im_end|>") == [im_end]  # declared normal, treated as control
    assert tok.is_special(im_end) and tok.token_bytes(im_end) == b""


def test_invalid_token_ids_are_named_errors():
    tok = Tokenizer.from_metadata(gpt2_metadata())
    for bad in (-1, tok.vocab_size):
        with pytest.raises(InvalidTokenIdError, match="out of range"):
            tok.token_bytes(bad)
        with pytest.raises(InvalidTokenIdError):
            tok.decode([bad])


def test_lone_surrogates_become_replacement_characters():
    tok = Tokenizer.from_metadata(gpt2_metadata())
    assert tok.decode(tok.encode("a\ud83db")) == "a\ufffdb"


def test_decode_renders_specials_only_when_asked():
    tok = Tokenizer.from_metadata(gpt2_metadata())
    ids = tok.encode("hi<|endoftext|>")
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special=False) == "hi<|endoftext|>"


# ------------------------------------------------------------------ SentencePiece


def test_spm_merges_by_score_not_by_order():
    def spm_pieces(ab: float, bc: float) -> list[str]:
        words = {"a": -1.0, "b": -1.0, "c": -1.0, "ab": ab, "bc": bc}
        meta = spm_metadata(words, **{"tokenizer.ggml.add_space_prefix": False})
        tok = Tokenizer.from_metadata(meta)
        return [tok.token_text(i) for i in tok.encode("abc", add_special=False)]

    assert spm_pieces(ab=-3.0, bc=-2.0) == ["a", "bc"]
    assert spm_pieces(ab=-2.0, bc=-3.0) == ["ab", "c"]


def test_spm_adds_bos_by_default_and_falls_back_to_bytes():
    tok = Tokenizer.from_metadata(spm_metadata(**{"tokenizer.ggml.add_space_prefix": False}))
    assert tok.add_bos is True and tok.bos_id == 1
    ids = tok.encode("aé")
    assert ids[0] == 1
    assert [tok.token_text(i) for i in ids[1:]] == ["a", "<0xC3>", "<0xA9>"]
    assert [tok.token_bytes(i) for i in ids[1:]] == [b"a", b"\xc3", b"\xa9"]
    assert tok.decode(ids) == "aé"


def test_spm_space_prefix_goes_after_every_special_token_like_llama_cpp():
    tok = Tokenizer.from_metadata(spm_metadata())  # add_space_prefix absent -> True
    assert tok.add_space_prefix is True
    ids = tok.encode("a</s>a", add_special=False)
    assert [tok.token_text(i) for i in ids] == ["▁a", "</s>", "▁a"]
    assert tok.decode(ids, skip_special=False) == "a</s> a"
    assert tok.decode(tok.encode("a b")) == "a b"  # the dummy prefix is dropped on decode
    assert tok.decode(tok.encode("a b"), strip_prefix_space=False) == " a b"


def test_spm_spaces_are_escaped_and_not_collapsed():
    tok = Tokenizer.from_metadata(spm_metadata(**{"tokenizer.ggml.add_space_prefix": False}))
    ids = tok.encode("a  b", add_special=False)
    assert [tok.token_text(i) for i in ids] == ["a", "▁", "▁", "b"]
    assert tok.token_bytes(ids[1]) == b" "


# ------------------------------------------------------------------ real vocabularies

SMOLLM2_LLAMA_CPP = [
    ("Hello world", True, True, [19556, 905]),
    ("<|im_start|>user\nhi<|im_end|>\n", True, True, [1, 4093, 198, 6004, 2, 198]),
    (
        "<|im_start|>user\nhi<|im_end|>\n",
        False,
        False,
        [44, 108, 306, 79, 3738, 108, 46, 4093, 198, 6004, 44, 108, 306, 79, 486, 108, 46, 198],
    ),
    (
        'In 2024, 12345 people said: "don\'t"!',
        False,
        True,
        [788, 216, 34, 32, 34, 36, 28, 216, 33, 34, 35, 36, 37, 701, 1137, 42, 476, 12420, 982]
        + [18, 17],
    ),
    (
        "a\n\nb  c\u2003d \U0001f9ff\U0001fae8",
        True,
        True,
        [81, 198, 198, 82, 216, 265, 321, 221, 84, 15107, 117, 140, 10813, 121, 118],
    ),
]

GEMMA3_LLAMA_CPP = [
    ("Hello world", True, True, [2, 9259, 1902]),
    ("<start_of_turn>user\nhi<end_of_turn>\n", True, True, [2, 105, 2364, 107, 2202, 106, 107]),
    (
        "<start_of_turn>user\nhi<end_of_turn>\n",
        False,
        False,
        [236820, 3041, 236779, 1340, 236779, 887, 236813, 2364, 107, 2202, 236820, 643, 236779]
        + [1340, 236779, 887, 236813, 107],
    ),
    (
        'In 2024, 12345 people said: "don\'t"!',
        False,
        True,
        [902, 236743, 236778, 236771, 236778, 236812, 236764, 236743, 236770, 236778, 236800]
        + [236812, 236810, 1331, 1176, 236787, 623, 13246, 236789, 236745, 118659],
    ),
    (
        "a\n\nb  c\u2003d \U0001f9ff\U0001fae8",
        True,
        True,
        [2, 236746, 108, 236763, 138, 236755, 464, 366, 369, 236753, 236743, 248979]
        + [478, 397, 409, 406],
    ),
    ("<bos>", False, True, [2]),
    ("<bos>", False, False, [236820, 46757, 236813]),
]


@pytest.mark.parametrize(("text", "add_special", "parse_special", "expected"), SMOLLM2_LLAMA_CPP)
def test_smollm2_matches_llama_cpp(smollm2_tokenizer, text, add_special, parse_special, expected):
    assert smollm2_tokenizer.encode(text, add_special, parse_special) == expected
    assert smollm2_tokenizer.decode(expected, skip_special=False) == text


def test_smollm2_vocab_facts(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert (tok.kind, tok.vocab_size, tok.bos_id, tok.eos_id) == ("gpt2", 49152, 1, 2)
    assert tok.add_bos is False and tok.add_space_prefix is False
    assert tok.token_text(1) == "<|im_start|>" and tok.token_text(2) == "<|im_end|>"
    assert tok.stop_ids == {0, 2}  # <|endoftext|> and <|im_end|>
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template


@pytest.mark.slow
@pytest.mark.parametrize(("text", "add_special", "parse_special", "expected"), GEMMA3_LLAMA_CPP)
def test_gemma3_matches_llama_cpp(gemma3_tokenizer, text, add_special, parse_special, expected):
    assert gemma3_tokenizer.encode(text, add_special, parse_special) == expected
    bos = "<bos>" if add_special else ""
    assert gemma3_tokenizer.decode(expected, skip_special=False) == bos + text


@pytest.mark.slow
def test_gemma3_vocab_facts(gemma3_tokenizer):
    tok = gemma3_tokenizer
    assert (tok.kind, tok.vocab_size, tok.bos_id, tok.eos_id) == ("llama", 262144, 2, 1)
    assert tok.add_bos is True and tok.add_space_prefix is False
    assert tok.stop_ids == {1, 106}  # <eos> and <end_of_turn>
    assert tok.chat_template is None
    assert tok.token_bytes(107) == b"\n" and tok.token_bytes(138) == b"  "  # user-defined
    assert tok.token_bytes(tok.encode("\U0001fae8", add_special=False)[0]) == b"\xf0"


@pytest.mark.slow
def test_gemma3_builds_quickly(gemma3_metadata):
    started = time.process_time()  # CPU time: what busy neighbours take is not the build's
    tok = Tokenizer.from_metadata(gemma3_metadata)
    assert time.process_time() - started < 3.0
    assert tok.vocab_size == 262144


def test_spm_model_is_built_once_per_vocabulary(tmp_path, monkeypatch):
    """The second tokenizer of a vocabulary reads the SPM model the first one kept in
    LLMQ_CACHE_DIR and tokenizes alike; another vocabulary builds its own."""
    monkeypatch.setenv("LLMQ_CACHE_DIR", str(tmp_path))
    meta = spm_metadata(**{"tokenizer.ggml.add_space_prefix": False})
    first = Tokenizer.from_metadata(meta)
    assert len(list((tmp_path / "tokenizers").iterdir())) == 1

    def no_building(*args, **kwargs):
        raise AssertionError("the SPM model was built again")

    with monkeypatch.context() as patched:
        patched.setattr(tokenizer_backends, "_spm_proto", no_building)
        second = Tokenizer.from_metadata(meta)
    for text in ("abc", "aé", "a b  c"):
        assert second.encode(text) == first.encode(text)

    Tokenizer.from_metadata(spm_metadata({"a": -1.0, "b": -2.0}))
    assert len(list((tmp_path / "tokenizers").iterdir())) == 2
