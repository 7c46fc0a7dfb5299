"""A model's vocabulary as llguidance reads it, for grammar-constrained decoding.

llguidance computes token masks over the *bytes* each token stands for. Those come from
our own tokenizer (`Tokenizer.token_bytes`: GPT-2 byte-level characters mapped back to
bytes, SentencePiece `▁` as a space and `<0xNN>` as that byte); control and unknown tokens
are marked special (llguidance's convention: a 0xFF byte before their text), so no grammar
can produce them except EOS when it allows the sequence to end. The list is as long as the
model's logits: ids past the tokenizer's vocabulary (a padded LM head) get no bytes and are
never allowed.
"""

from __future__ import annotations

import os
import threading
from functools import cached_property
from typing import TYPE_CHECKING

import llguidance

from runtime.errors import TokenizerError
from runtime.tokenizer_backends import CONTROL, UNKNOWN

if TYPE_CHECKING:  # runtime.sampling imports this module's users; keep the graph acyclic
    from runtime.tokenizer import Tokenizer

SPECIAL_PREFIX = b"\xff"
"""llguidance reads a token whose bytes start with 0xFF (never valid UTF-8) as special."""


def grammar_token_bytes(tokenizer: Tokenizer, n_vocab: int) -> tuple[list[bytes], list[int]]:
    """(bytes of every id in [0, n_vocab), the special ids): what llguidance matches on."""
    if n_vocab < tokenizer.vocab_size:
        raise ValueError(
            f"n_vocab must cover the tokenizer's {tokenizer.vocab_size} tokens, got {n_vocab}."
        )
    tokens: list[bytes] = []
    special: list[int] = []
    for token_id in range(tokenizer.vocab_size):
        if tokenizer.token_type(token_id) in (CONTROL, UNKNOWN):
            special.append(token_id)
            tokens.append(SPECIAL_PREFIX + tokenizer.token_text(token_id).encode("utf-8"))
        else:
            tokens.append(tokenizer.token_bytes(token_id))
    tokens.extend(b"" for _ in range(n_vocab - tokenizer.vocab_size))  # padded LM head rows
    return tokens, special


class _TokenizerSource:
    """The object `llguidance.LLTokenizer` builds from (its `TokenizerWrapper` protocol)."""

    is_tokenizer_wrapper = True

    def __init__(self, tokenizer: Tokenizer, n_vocab: int, eos_ids: list[int]) -> None:
        self.tokens, self.special_token_ids = grammar_token_bytes(tokenizer, n_vocab)
        self.eos_token_id = eos_ids[0]
        self.bos_token_id = tokenizer.bos_id
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        # llguidance tokenizes grammar text (never control tokens) to check canonical forms
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special=False, parse_special=False)


class GrammarVocab:
    """One model's llguidance tokenizer and mask executor, built on first use (the token
    byte table of a 262k vocabulary takes about a second) and then shared by every
    constrained sequence of the engine."""

    def __init__(self, tokenizer: Tokenizer, n_vocab: int) -> None:
        self.tokenizer = tokenizer
        self.n_vocab = n_vocab  # the logits' width
        self._lock = threading.Lock()
        self._lltokenizer: llguidance.LLTokenizer | None = None

    @property
    def eos_ids(self) -> list[int]:
        """The tokens a finished grammar allows: EOS first, then the other end tokens."""
        eos = self.tokenizer.eos_id
        ids = ([eos] if eos is not None else []) + sorted(self.tokenizer.stop_ids - {eos})
        if not ids:
            raise TokenizerError(
                "constrained decoding needs an end-of-sequence token; this vocabulary has none"
            )
        return ids

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:  # a worker may validate requests on another thread
            if self._lltokenizer is None:
                eos = self.eos_ids
                source = _TokenizerSource(self.tokenizer, self.n_vocab, eos)
                self._lltokenizer = llguidance.LLTokenizer(
                    source, n_vocab=self.n_vocab, eos_token=eos
                )
            return self._lltokenizer

    @cached_property
    def executor(self) -> llguidance.LLExecutor:
        """Computes the masks of a batch's constrained rows in parallel (Rust threads).

        One thread per core this process may use: masks are computed between forward
        passes, when the kernels' threads are idle (llguidance's default, 80% of the
        cores, leaves one of two idle: Gemma's 32 masks took 8.5 ms instead of 6.2)."""
        return llguidance.LLExecutor(min(len(os.sched_getaffinity(0)), 32))
