"""Small hand-made GGUF tokenizer metadata for fast tokenizer tests (no model file needed)."""

from __future__ import annotations

from typing import Any

from runtime.tokenizer_backends import byte_to_unicode

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6


def gpt2_metadata(
    specials: dict[str, int] | None = None, merges: list[str] | None = None, **extra: Any
) -> dict[str, Any]:
    """Byte-level BPE: all 256 byte characters, the merges' results, then `specials`.

    `specials` maps token text to GGUF token type; a merge "a b" adds token "ab".
    """
    merges = merges if merges is not None else ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
    chars = [byte_to_unicode()[b] for b in range(256)]
    merged = [m.replace(" ", "") for m in merges]
    specials = specials if specials is not None else {"<|endoftext|>": CONTROL}
    tokens = chars + merged + list(specials)
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [NORMAL] * (len(chars) + len(merged))
        + list(specials.values()),
        "tokenizer.ggml.merges": merges,
    }
    if "<|endoftext|>" in specials:
        meta["tokenizer.ggml.eos_token_id"] = tokens.index("<|endoftext|>")
    meta.update(extra)
    return meta


def spm_metadata(
    words: dict[str, float] | None = None, specials: dict[str, int] | None = None, **extra: Any
) -> dict[str, Any]:
    """SentencePiece vocab: <unk> <s> </s>, 256 byte tokens, `words` (piece -> score), specials."""
    words = words if words is not None else {"▁": -1.0, "a": -2.0, "b": -3.0, "▁a": -4.0}
    specials = specials or {}
    head = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = head + byte_tokens + list(words) + list(specials)
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * (3 + 256) + list(words.values()) + [0.0] * len(specials),
        "tokenizer.ggml.token_type": [UNKNOWN, CONTROL, CONTROL]
        + [BYTE] * 256
        + [NORMAL] * len(words)
        + list(specials.values()),
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    meta.update(extra)
    return meta
