"""The two tokenization engines behind `runtime.tokenizer.Tokenizer`, built from GGUF metadata.

Each backend turns *raw text with no special tokens in it* into ids; splitting special tokens
out, BOS/EOS and decoding live in `runtime.tokenizer`. The GPT-2 byte-level BPE backend
uses Hugging Face `tokenizers` with llama.cpp's pre-tokenizer regexes
(runtime/pre_tokenizers.py); the
SentencePiece backend builds an SPM `ModelProto` in memory, because that is what merges by
score exactly as llama.cpp's SPM tokenizer does.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Protocol

import numpy as np
import sentencepiece
from sentencepiece import sentencepiece_model_pb2 as spm_pb2
from tokenizers import Regex, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from runtime.cache_dir import cache_dir, source_digest, write_atomically
from runtime.errors import TokenizerError
from runtime.pre_tokenizers import IGNORE_MERGES, pre_tokenizer

log = logging.getLogger(__name__)

# GGUF token types (gguf.TokenType); llama.cpp maps them to token attributes one to one.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


class Backend(Protocol):
    """Raw text (no special tokens inside) -> token ids."""

    def encode(self, text: str) -> list[int]: ...


@cache
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabs."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@cache
def unicode_to_byte() -> dict[str, int]:
    return {ch: b for b, ch in byte_to_unicode().items()}


class BpeBackend:
    """GPT-2 style byte-level BPE: llama.cpp's regex pre-split, then merges by rank."""

    def __init__(self, tokens: Sequence[str], merges: Sequence[str], pre: str | None) -> None:
        regexes, name = pre_tokenizer(pre)
        vocab = {text: i for i, text in enumerate(tokens)}
        pairs = _merge_pairs(merges, vocab)
        model = models.BPE(vocab=vocab, merges=pairs, ignore_merges=name in IGNORE_MERGES)
        hf = HFTokenizer(model)
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        # use_regex=False: the splits above already did GPT-2's regex job; this only maps bytes.
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        self.pre_name = name
        self._hf = hf

    def encode(self, text: str) -> list[int]:
        return self._hf.encode(text, add_special_tokens=False).ids


class SpmStyleBpeBackend:
    """BPE over raw UTF-8 with spaces written as U+2581, as Gemma 4's vocabulary is (llama.cpp's
    GEMMA4 pre-type): the text is split only at newlines, merged by rank, and a character no
    token holds falls back to its `<0xXX>` byte tokens. A run of newlines that is a token is
    taken whole, as llama.cpp does, whatever the merges would make of it."""

    def __init__(self, tokens: Sequence[str], merges: Sequence[str]) -> None:
        self._vocab = vocab = {text: i for i, text in enumerate(tokens)}
        model = models.BPE(vocab=vocab, merges=_merge_pairs(merges, vocab), byte_fallback=True)
        self._hf = HFTokenizer(model)
        self._words = re.compile(r"[^\n]+|\n+")

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for word in self._words.findall(text.replace(" ", "\u2581")):
            whole = self._vocab.get(word) if word[0] == "\n" else None
            if whole is not None:
                ids.append(whole)
            else:
                ids.extend(self._hf.encode(word, add_special_tokens=False).ids)
        return ids


def _merge_pairs(merges: Sequence[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """GGUF "a b" merge strings -> pairs, split like llama.cpp (first space after index 0)."""
    pairs: list[tuple[str, str]] = []
    dropped = 0
    for merge in merges:
        cut = merge.find(" ", 1)
        left, right = merge[:cut], merge[cut + 1 :]
        # tokenizers rejects merges whose parts or result are not in the vocab
        if cut < 0 or left not in vocab or right not in vocab or left + right not in vocab:
            dropped += 1
            continue
        pairs.append((left, right))
    if dropped:
        log.warning("dropped %d BPE merges that reference tokens missing from the vocab", dropped)
    return pairs


class SpmBackend:
    """SentencePiece BPE over an in-memory ModelProto, merging by score like llama.cpp."""

    def __init__(
        self,
        tokens: Sequence[str],
        scores: Sequence[float] | None,
        types: Sequence[int],
        *,
        unk_id: int | None,
        add_space_prefix: bool,
    ) -> None:
        model = _spm_model((tokens, scores, types, unk_id, add_space_prefix))
        self.vocab_size = len(tokens)
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_proto=model)
        except RuntimeError as exc:
            raise TokenizerError(f"SentencePiece rejected the GGUF vocabulary: {exc}") from exc
        self.unk_id = self._sp.unk_id()

    def encode(self, text: str) -> list[int]:
        ids = self._sp.encode(text)
        if self.unk_id >= self.vocab_size and self.unk_id in ids:
            # llama.cpp cannot tokenize this either (no byte tokens, no unknown token).
            raise TokenizerError(
                "text holds a character this vocabulary cannot represent "
                "(it has neither byte tokens nor an unknown token)"
            )
        return ids


def _spm_model(
    vocabulary: tuple[Sequence[str], Sequence[float] | None, Sequence[int], int | None, bool],
) -> bytes:
    """The serialized SPM model of `_spm_proto`, built once per vocabulary (and this file's
    code) and kept in LLMQ_CACHE_DIR/tokenizers: building Gemma 3's 262k pieces took 0.25 s
    of every load, hashing them takes 0.02."""
    tokens, scores, types, unk_id, add_space_prefix = vocabulary
    digest = hashlib.sha256(source_digest(Path(__file__)).encode())
    digest.update(repr((unk_id, add_space_prefix, len(tokens))).encode())
    digest.update("\0".join(tokens).encode("utf-8", "surrogatepass"))
    digest.update(np.asarray(scores if scores is not None else [], np.float32).tobytes())
    digest.update(np.asarray(types, np.int64).tobytes())
    path = cache_dir() / "tokenizers" / f"spm-{digest.hexdigest()[:24]}.model"
    try:
        return path.read_bytes()
    except OSError:
        pass
    model = _spm_proto(*vocabulary).SerializeToString()
    try:
        write_atomically(path, lambda partial: partial.write_bytes(model))
    except OSError:  # a read-only cache costs the next load this build, nothing more
        pass
    return model


def _spm_proto(
    tokens: Sequence[str],
    scores: Sequence[float] | None,
    types: Sequence[int],
    unk_id: int | None,
    add_space_prefix: bool,
) -> spm_pb2.ModelProto:
    """The SPM model llama.cpp's tokenizer amounts to.

    llama.cpp merges into *any* vocab entry, control tokens included, and finds special
    tokens itself before merging; SentencePiece would refuse to merge into CONTROL pieces
    and would match USER_DEFINED pieces on its own. So every piece is NORMAL here except the
    one UNKNOWN piece and the BYTE pieces (which SentencePiece needs for byte fallback).
    """
    piece_type = spm_pb2.ModelProto.SentencePiece
    if unk_id is None or not 0 <= unk_id < len(tokens):
        unk_id = next((i for i, t in enumerate(types) if t == UNKNOWN), None)
    proto = spm_pb2.ModelProto()
    pieces = proto.pieces
    has_bytes = False
    for i, text in enumerate(tokens):
        kind = piece_type.NORMAL
        if i == unk_id:
            kind = piece_type.UNKNOWN
        elif types[i] == BYTE:
            kind = piece_type.BYTE
            has_bytes = True
        pieces.add(piece=text, score=scores[i] if scores is not None else 0.0, type=kind)
    if unk_id is None:
        # SentencePiece insists on an unknown piece; park one past the real vocab.
        unk_id = len(tokens)
        pieces.add(piece="<llmq-unk>", score=0.0, type=piece_type.UNKNOWN)
    trainer = proto.trainer_spec
    trainer.model_type = spm_pb2.TrainerSpec.BPE
    trainer.vocab_size = len(pieces)
    trainer.byte_fallback = has_bytes
    trainer.unk_id = unk_id
    normalizer = proto.normalizer_spec
    normalizer.name = "identity"
    normalizer.add_dummy_prefix = add_space_prefix
    normalizer.remove_extra_whitespaces = False
    normalizer.escape_whitespaces = True
    return proto
