"""The two tokenization engines behind `runtime.tokenizer.Tokenizer`, built from GGUF metadata.

Each backend turns *raw text with no special tokens in it* into ids; splitting special tokens
out, BOS/EOS and decoding live in `runtime.tokenizer`. The GPT-2 byte-level BPE backend
uses Hugging Face `tokenizers` with llama.cpp's pre-tokenizer regexes (llama-vocab.cpp); the
SentencePiece backend builds an SPM `ModelProto` in memory, because that is what merges by
score exactly as llama.cpp's SPM tokenizer does.
"""

from __future__ import annotations

import hashlib
import logging
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

log = logging.getLogger(__name__)

# GGUF token types (gguf.TokenType); llama.cpp maps them to token attributes one to one.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")

# Pre-tokenizer name (`tokenizer.ggml.pre`) -> regexes applied in turn, as llama.cpp does:
# each regex splits the pieces the previous one produced, keeping unmatched gaps as pieces.
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
_DIGITS_THEN_GPT2 = (r"\p{N}", _GPT2)
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "default": _DEFAULT,
    "gpt2": (_GPT2,),
    "gpt-2": (_GPT2,),
    "phi-2": (_GPT2,),
    "mpt": (_GPT2,),
    "olmo": (_GPT2,),
    "jais": (_GPT2,),
    "roberta-bpe": (_GPT2,),
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
    "command-r": _DIGITS_THEN_GPT2,
    "codeshell": _DIGITS_THEN_GPT2,
    "exaone": _DIGITS_THEN_GPT2,
    "minerva-7b": _DIGITS_THEN_GPT2,
    "llama3": (_LLAMA3,),
    "llama-v3": (_LLAMA3,),
    "llama-bpe": (_LLAMA3,),
    "falcon3": (_LLAMA3,),
    "dbrx": (_LLAMA3,),
    "smaug-bpe": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "stablelm2": (_QWEN2,),
    "megrez": (_QWEN2,),
    "deepseek-r1-qwen": (_QWEN2,),
}
# llama.cpp's LLAMA3 pre-type: a whole pre-token found in the vocab skips merging, and
# BOS is added by default.
LLAMA3_PRE_NAMES = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3"})


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
        regexes, name = _pre_regexes(pre)
        vocab = {text: i for i, text in enumerate(tokens)}
        pairs = _merge_pairs(merges, vocab)
        model = models.BPE(vocab=vocab, merges=pairs, ignore_merges=name in LLAMA3_PRE_NAMES)
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


def _pre_regexes(pre: str | None) -> tuple[tuple[str, ...], str]:
    if not pre:
        # llama.cpp's own choice for a missing name; it warns the same way.
        log.warning("GGUF has no tokenizer.ggml.pre; using llama.cpp's 'default' pre-tokenizer")
        return PRE_TOKENIZERS["default"], "default"
    if pre not in PRE_TOKENIZERS:
        log.warning("unknown pre-tokenizer %r; falling back to gpt2 (tokens may differ)", pre)
        return PRE_TOKENIZERS["gpt2"], "gpt2"
    return PRE_TOKENIZERS[pre], pre


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
