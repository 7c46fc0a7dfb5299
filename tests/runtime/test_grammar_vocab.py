"""The model's vocabulary as llguidance reads it: token bytes, special tokens, padded ids."""

from __future__ import annotations

import re
from pathlib import Path

import llguidance
import numpy as np
import pytest

from runtime.constraints import Constraint, GrammarMatcher, apply_grammar_masks
from runtime.errors import TokenizerError
from runtime.gguf_file import GGUFFile
from runtime.grammar_vocab import SPECIAL_PREFIX, GrammarVocab, grammar_token_bytes
from runtime.tokenizer import Tokenizer


def _tokenizer(path: Path) -> Tokenizer:
    return Tokenizer.from_metadata(GGUFFile(path).metadata)


def test_byte_level_bpe_tokens_are_their_bytes(tiny_llama_path):
    tokenizer = _tokenizer(tiny_llama_path)
    tokens, special = grammar_token_bytes(tokenizer, tokenizer.vocab_size)
    ids = {tokenizer.token_text(i): i for i in range(tokenizer.vocab_size)}
    assert tokens[ids["\u0120the"]] == b" the"  # GPT-2's stand-in for the space byte
    assert tokens[ids["\u010a"]] == b"\n"
    assert tokens[ids["\u00c3"]] == b"\xc3"  # half of a UTF-8 character, as a raw byte
    assert sorted(special) == [ids["<|endoftext|>"], ids["<|im_start|>"], ids["<|im_end|>"]]
    assert tokens[ids["<|im_end|>"]] == SPECIAL_PREFIX + b"<|im_end|>"


def test_sentencepiece_tokens_are_their_bytes(tiny_gemma3_path):
    tokenizer = _tokenizer(tiny_gemma3_path)
    tokens, special = grammar_token_bytes(tokenizer, tokenizer.vocab_size)
    ids = {tokenizer.token_text(i): i for i in range(tokenizer.vocab_size)}
    assert tokens[ids["\u2581the"]] == b" the"
    assert tokens[ids["<0x41>"]] == b"A"
    assert tokens[ids["<0xE2>"]] == b"\xe2"
    assert {ids["<eos>"], ids["<unk>"], ids["<end_of_turn>"]} <= set(special)
    assert ids["he"] not in special


def test_lltokenizer_decodes_like_our_tokenizer(tiny_model_path):
    tokenizer = _tokenizer(tiny_model_path)
    vocab = GrammarVocab(tokenizer, tokenizer.vocab_size)
    ids = tokenizer.encode("in the heat, a thinner théâtre\n", add_special=False)
    assert vocab.lltokenizer.decode_bytes(ids) == b"".join(map(tokenizer.token_bytes, ids))
    assert vocab.lltokenizer.vocab_size == tokenizer.vocab_size
    assert vocab.lltokenizer.eos_tokens == vocab.eos_ids
    assert vocab.eos_ids[0] == tokenizer.eos_id
    assert all(vocab.lltokenizer.is_special_token(t) for t in tokenizer.stop_ids)


def test_a_regex_mask_allows_exactly_the_tokens_whose_bytes_fit(tiny_model_path):
    tokenizer = _tokenizer(tiny_model_path)
    padded = tokenizer.vocab_size + 7  # an LM head wider than the vocabulary
    vocab = GrammarVocab(tokenizer, padded)
    matcher = GrammarMatcher(vocab, Constraint("regex", "[a-z]+"))
    logits = np.zeros((2, padded), np.float32)
    apply_grammar_masks(vocab, logits, [1], [matcher])
    allowed = set(np.flatnonzero(np.isfinite(logits[1])).tolist())
    expected = {
        t
        for t in range(tokenizer.vocab_size)
        if not tokenizer.is_special(t) and re.fullmatch(rb"[a-z]+", tokenizer.token_bytes(t))
    }
    assert allowed == expected and len(expected) >= 26
    assert np.isfinite(logits[0]).all()  # the unconstrained row is untouched


def test_a_finished_grammar_allows_only_the_end_tokens(tiny_llama_path):
    tokenizer = _tokenizer(tiny_llama_path)
    vocab = GrammarVocab(tokenizer, tokenizer.vocab_size)
    matcher = GrammarMatcher(vocab, Constraint("regex", "ab?"))
    matcher.consume(tokenizer.encode("a", add_special=False)[0])
    assert not matcher.done  # "b" may still come
    logits = np.zeros((1, tokenizer.vocab_size), np.float32)
    apply_grammar_masks(vocab, logits, [0], [matcher])
    allowed = set(np.flatnonzero(np.isfinite(logits[0])).tolist())
    assert allowed == {tokenizer.encode("b", add_special=False)[0], *vocab.eos_ids}
    matcher.consume(tokenizer.encode("b", add_special=False)[0])
    assert matcher.done and matcher.error is None


def test_a_vocabulary_without_an_end_token_is_refused(tiny_llama_path):
    tokenizer = _tokenizer(tiny_llama_path)
    tokenizer.eos_id, tokenizer.stop_ids = None, frozenset()
    vocab = GrammarVocab(tokenizer, tokenizer.vocab_size)
    with pytest.raises(TokenizerError, match="end-of-sequence"):
        _ = vocab.lltokenizer


@pytest.mark.slow
def test_gemma_sentencepiece_vocabulary_builds(gemma3_gguf_path):
    tokenizer = _tokenizer(gemma3_gguf_path)
    vocab = GrammarVocab(tokenizer, tokenizer.vocab_size)
    text = " Paris, 2025 — naïve"
    ids = tokenizer.encode(text, add_special=False)
    assert vocab.lltokenizer.decode_str(ids) == text
    assert vocab.lltokenizer.tokenize_str(text) == ids  # it tokenizes through our tokenizer
    matcher = llguidance.LLMatcher(vocab.lltokenizer, Constraint("regex", "[0-9]{2}").grammar)
    assert not matcher.is_error()
