"""Text <-> token ids for a GGUF model, from its metadata alone, with llama.cpp's semantics.

`Tokenizer.from_metadata(meta)` reads the `tokenizer.ggml.*` keys and picks a backend from
`runtime.tokenizer_backends` (GPT-2 byte-level BPE or SentencePiece). Around the backend
this module does what llama.cpp's `llama_tokenize` does: special tokens written in the text
are split out first (control tokens only when `parse_special`, user-defined tokens always),
BOS/EOS are added as the metadata asks, and decoding is byte-exact via `token_bytes`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from runtime.errors import InvalidTokenIdError, TokenizerError, UnsupportedTokenizerError
from runtime.pre_tokenizers import ADD_BOS_BY_DEFAULT
from runtime.tokenizer_backends import (
    BYTE,
    CONTROL,
    UNKNOWN,
    UNUSED,
    USER_DEFINED,
    Backend,
    BpeBackend,
    SpmBackend,
    SpmStyleBpeBackend,
    unicode_to_byte,
)

log = logging.getLogger(__name__)

# Texts llama.cpp treats as end-of-generation whatever their declared type (llama-vocab.cpp).
END_OF_TURN_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<|return|>",
        "<|call|>",
    }
)
_STOP_ID_KEYS = (
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
    "tokenizer.ggml.fim_pad_token_id",
    "tokenizer.ggml.fim_rep_token_id",
    "tokenizer.ggml.fim_sep_token_id",
)
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPECIAL = (CONTROL, UNKNOWN)  # never text unless asked for
_TRIE_END = ""  # trie key marking a complete special token (no real character is "")
_SURROGATE = re.compile("[\ud800-\udfff]")


class Tokenizer:
    """A model's vocabulary and tokenizer; build it with `Tokenizer.from_metadata`."""

    def __init__(
        self,
        *,
        kind: str,
        tokens: Sequence[str],
        types: Sequence[int],
        backend: Backend,
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool,
        add_eos: bool,
        add_space_prefix: bool,
        stop_ids: Iterable[int],
        chat_template: str | None = None,
    ) -> None:
        self.kind = kind  # "gpt2", "llama" or "gemma4", as in tokenizer.ggml.model
        self._tokens = list(tokens)
        self._types = list(types)
        self._backend = backend
        self.bos_id, self.eos_id = bos_id, eos_id
        self.add_bos, self.add_eos = add_bos, add_eos
        self.add_space_prefix = add_space_prefix
        self.stop_ids = frozenset(stop_ids)
        self.chat_template = chat_template
        self._splitter = _SpecialSplitter(self._tokens, self._types)
        self._bytes: list[bytes | None] = [None] * len(self._tokens)

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata (`{key: field.contents()}`); nothing else is read."""
        kind = meta.get("tokenizer.ggml.model")
        build = _BACKENDS.get(kind)
        if build is None:
            raise UnsupportedTokenizerError(
                f"tokenizer.ggml.model is {kind!r}; expected 'gpt2' (byte-level BPE), "
                "'llama' (SentencePiece) or 'gemma4' (BPE over U+2581-escaped text)"
            )
        tokens = _token_texts(meta)
        types = _token_types(meta, tokens)
        backend, add_space_prefix, default_add_bos = build(meta, tokens, types)
        return cls(
            kind=kind,
            tokens=tokens,
            types=types,
            backend=backend,
            bos_id=_token_id(meta, "tokenizer.ggml.bos_token_id", len(tokens)),
            eos_id=_token_id(meta, "tokenizer.ggml.eos_token_id", len(tokens)),
            # llama.cpp adds BOS for Gemma 4 even where its GGUF says not to
            add_bos=kind == "gemma4"
            or bool(meta.get("tokenizer.ggml.add_bos_token", default_add_bos)),
            add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            add_space_prefix=add_space_prefix,
            stop_ids=_stop_ids(meta, tokens),
            chat_template=meta.get("tokenizer.chat_template"),
        )

    # ----------------------------------------------------------------- vocabulary

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def eot_ids(self) -> frozenset[int]:
        """Same set as `stop_ids`: EOS plus every end-of-turn / end-of-generation token."""
        return self.stop_ids

    def token_text(self, token_id: int) -> str:
        """The token's string as stored in the GGUF (byte-level or U+2581-escaped)."""
        return self._tokens[self._check(token_id)]

    def token_type(self, token_id: int) -> int:
        """GGUF token type: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte."""
        return self._types[self._check(token_id)]

    def is_special(self, token_id: int) -> bool:
        """Control and unknown tokens: they stand for no text."""
        return self._types[self._check(token_id)] in _SPECIAL

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes the token stands for; b"" for control, unknown and unused tokens."""
        cached = self._bytes[self._check(token_id)]
        if cached is None:
            cached = self._bytes[token_id] = self._compute_bytes(token_id)
        return cached

    def _compute_bytes(self, token_id: int) -> bytes:
        text, kind = self._tokens[token_id], self._types[token_id]
        if kind in (CONTROL, UNKNOWN, UNUSED):
            return b""
        if kind == USER_DEFINED:
            return text.encode("utf-8")  # stored pre-normalized, as raw text
        if kind == BYTE and (match := _BYTE_TOKEN.fullmatch(text)):
            return bytes([int(match.group(1), 16)])
        if self.kind != "gpt2":  # SentencePiece and Gemma 4 write a space as U+2581
            return text.replace("\u2581", " ").encode("utf-8")
        table = unicode_to_byte()
        return b"".join(bytes([table[ch]]) if ch in table else ch.encode("utf-8") for ch in text)

    def _check(self, token_id: int) -> int:
        if not 0 <= token_id < len(self._tokens):
            raise InvalidTokenIdError(
                f"token id {token_id} is out of range; expected 0 <= id < {len(self._tokens)}"
            )
        return token_id

    # ----------------------------------------------------------------- encode / decode

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids for `text`, as llama.cpp's `llama_tokenize(add_special, parse_special)`.

        `add_special` adds BOS/EOS only where the metadata asks for them; `parse_special`
        turns control-token text such as `<|im_start|>` into its single id (otherwise it is
        tokenized as plain text). User-defined tokens are always matched whole.
        """
        ids: list[int] = []
        if add_special and self.add_bos:
            ids.append(self._required(self.bos_id, "BOS"))
        for piece in self._splitter.split(_valid_unicode(text), parse_special):
            if isinstance(piece, int):
                ids.append(piece)
            else:
                ids.extend(self._backend.encode(piece))
        if add_special and self.add_eos:
            ids.append(self._required(self.eos_id, "EOS"))
        return ids

    def decode(
        self,
        ids: Iterable[int],
        skip_special: bool = True,
        strip_prefix_space: bool | None = None,
    ) -> str:
        """Text for `ids`; invalid UTF-8 (a sequence cut mid-character) becomes U+FFFD.

        `strip_prefix_space` (default: the model's `add_space_prefix`) drops the space an SPM
        model put in front of the text, so `decode(encode(text)) == text`.
        """
        strip = self.add_space_prefix if strip_prefix_space is None else strip_prefix_space
        parts: list[bytes] = []
        for token_id in ids:
            piece = self.piece_bytes(token_id, skip_special)
            if strip and piece and not self.is_special(token_id):
                piece = piece.removeprefix(b" ")
                strip = False
            parts.append(piece)
        return b"".join(parts).decode("utf-8", errors="replace")

    def piece_bytes(self, token_id: int, skip_special: bool = True) -> bytes:
        """`token_bytes`, or the token's own text for control/unknown tokens when not skipped."""
        if not skip_special and self.is_special(token_id):
            return self._tokens[token_id].encode("utf-8")
        return self.token_bytes(token_id)

    def _required(self, token_id: int | None, name: str) -> int:
        if token_id is None:
            raise TokenizerError(f"the metadata asks for a {name} token but defines none")
        return token_id


class _SpecialSplitter:
    """Splits special-token text out of a string exactly as llama.cpp's st_partition does.

    llama.cpp takes the special tokens longest first (by UTF-8 length) and cuts every
    leftmost, non-overlapping occurrence out of the remaining text pieces. A trie first
    finds which specials occur at all, so only those few are tried.
    """

    def __init__(self, tokens: Sequence[str], types: Sequence[int]) -> None:
        self._trie: dict[str, Any] = {}
        self._order: dict[int, tuple[int, int]] = {}
        self._always: set[int] = set()
        for token_id, (text, kind) in enumerate(zip(tokens, types, strict=True)):
            if kind not in (CONTROL, UNKNOWN, USER_DEFINED):
                continue
            node = self._trie
            for ch in text:
                node = node.setdefault(ch, {})
            node[_TRIE_END] = token_id
            self._order[token_id] = (-len(text.encode("utf-8")), token_id)
            if kind == USER_DEFINED:
                self._always.add(token_id)
        self._texts = {token_id: tokens[token_id] for token_id in self._order}
        starts = "".join(sorted(ch for ch in self._trie if ch != _TRIE_END))
        self._starts = re.compile(f"[{re.escape(starts)}]") if starts else None

    def split(self, text: str, parse_special: bool) -> list[str | int]:
        """Text pieces (str) and special token ids (int), in order; no empty pieces."""
        pieces: list[str | int] = [text] if text else []
        for token_id in sorted(self._present(text, parse_special), key=self._order.__getitem__):
            needle = self._texts[token_id]
            cut: list[str | int] = []
            for piece in pieces:
                if isinstance(piece, int) or needle not in piece:
                    cut.append(piece)
                    continue
                for k, part in enumerate(piece.split(needle)):
                    if k:
                        cut.append(token_id)
                    if part:
                        cut.append(part)
            pieces = cut
        return pieces

    def _present(self, text: str, parse_special: bool) -> set[int]:
        found: set[int] = set()
        if self._starts is None:
            return found
        for match in self._starts.finditer(text):
            node = self._trie
            for i in range(match.start(), len(text)):
                node = node.get(text[i])
                if node is None:
                    break
                token_id = node.get(_TRIE_END)
                if token_id is not None and (parse_special or token_id in self._always):
                    found.add(token_id)
        return found


def _bpe_backend(
    meta: Mapping[str, Any], tokens: Sequence[str], types: Sequence[int]
) -> tuple[Backend, bool, bool]:
    """(backend, add_space_prefix, default add_bos) for a gpt2 vocab, as llama.cpp sets them."""
    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        raise TokenizerError("a gpt2 tokenizer needs tokenizer.ggml.merges; it is missing")
    backend = BpeBackend(tokens, merges, meta.get("tokenizer.ggml.pre"))
    # llama.cpp never adds a space prefix for BPE; llama3-style and tekken vocabs add BOS
    return backend, False, backend.pre_name in ADD_BOS_BY_DEFAULT


def _spm_backend(
    meta: Mapping[str, Any], tokens: Sequence[str], types: Sequence[int]
) -> tuple[Backend, bool, bool]:
    """(backend, add_space_prefix, default add_bos) for a SentencePiece ("llama") vocab."""
    add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend = SpmBackend(
        tokens,
        meta.get("tokenizer.ggml.scores"),
        types,
        unk_id=_token_id(meta, "tokenizer.ggml.unknown_token_id", len(tokens)),
        add_space_prefix=add_space_prefix,
    )
    return backend, add_space_prefix, True


def _gemma4_backend(
    meta: Mapping[str, Any], tokens: Sequence[str], types: Sequence[int]
) -> tuple[Backend, bool, bool]:
    """(backend, add_space_prefix, default add_bos) for Gemma 4's vocab: llama.cpp adds BOS
    even where the GGUF says not to, and so do we."""
    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        raise TokenizerError("a gemma4 tokenizer needs tokenizer.ggml.merges; it is missing")
    return SpmStyleBpeBackend(tokens, merges), False, True


_BACKENDS = {"gpt2": _bpe_backend, "llama": _spm_backend, "gemma4": _gemma4_backend}


def _valid_unicode(text: str) -> str:
    """`text` with lone surrogates (e.g. from JSON "\\ud83d") replaced by U+FFFD."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)
    return text


def _token_texts(meta: Mapping[str, Any]) -> list[str]:
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise TokenizerError("GGUF metadata has no tokenizer.ggml.tokens")
    # llama.cpp renames empty tokens so every text stays a unique key
    texts = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    if len(set(texts)) != len(texts):
        raise TokenizerError("tokenizer.ggml.tokens holds duplicate token texts")
    return texts


def _token_types(meta: Mapping[str, Any], tokens: Sequence[str]) -> list[int]:
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(types) != len(tokens):
        raise TokenizerError(
            f"tokenizer.ggml.token_type has {len(types)} entries; expected {len(tokens)}"
        )
    for i, text in enumerate(tokens):
        if text in END_OF_TURN_TEXTS and types[i] != CONTROL:
            types[i] = CONTROL  # llama.cpp overrides these to control, and so do we
    return types


def _token_id(meta: Mapping[str, Any], key: str, n_vocab: int) -> int | None:
    value = meta.get(key)
    if value is None:
        return None
    if not 0 <= int(value) < n_vocab:
        log.warning("%s = %s is outside the vocab of %d; ignored", key, value, n_vocab)
        return None
    return int(value)


def _stop_ids(meta: Mapping[str, Any], tokens: Sequence[str]) -> set[int]:
    stops = {i for i, text in enumerate(tokens) if text in END_OF_TURN_TEXTS}
    for key in _STOP_ID_KEYS:
        token_id = _token_id(meta, key, len(tokens))
        if token_id is not None:
            stops.add(token_id)
    # gpt-oss (harmony): <|end|> ends a message, not the turn, where <|return|> and <|call|>
    # end turns; llama.cpp's llama-vocab.cpp drops it from the end tokens likewise
    texts = {tokens[i]: i for i in stops}
    if {"<|return|>", "<|call|>", "<|end|>"} <= texts.keys():
        stops.discard(texts["<|end|>"])
    return stops
