"""Streaming token ids -> text without ever emitting half of a UTF-8 character.

Byte-level BPE and SPM byte-fallback tokens can split one character (an emoji, a CJK
ideograph) across several tokens. `IncrementalDetokenizer` feeds each token's exact bytes
(`Tokenizer.piece_bytes`) into an incremental UTF-8 decoder, which holds an incomplete
sequence back until the rest arrives; so the concatenated output equals `Tokenizer.decode`.
"""

from __future__ import annotations

import codecs
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns one sequence's tokens into text as they arrive; one instance per sequence.

    `strip_prefix_space` drops the space an SPM model with `add_space_prefix` puts before
    the first word; leave it False when the tokens continue a prompt (generation), set it
    True to reproduce `tokenizer.decode(ids)` for a stream that starts a text.
    """

    def __init__(
        self, tokenizer: Tokenizer, skip_special: bool = True, strip_prefix_space: bool = False
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._strip = strip_prefix_space and tokenizer.add_space_prefix
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """The text this token completes; "" while a character is still incomplete."""
        data = self._tokenizer.piece_bytes(token_id, self._skip_special)
        if self._strip and data and not self._tokenizer.is_special(token_id):
            data = data.removeprefix(b" ")
            self._strip = False
        return self._utf8.decode(data)

    def flush(self) -> str:
        """Whatever is still buffered (an incomplete sequence becomes U+FFFD); then reset."""
        return self._utf8.decode(b"", final=True)
