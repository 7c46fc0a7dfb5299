"""Streaming token ids -> text without ever emitting half of a UTF-8 character.

Byte-level BPE and SPM byte-fallback tokens can split one character (an emoji, a CJK
ideograph) across several tokens. `IncrementalDetokenizer` feeds each token's exact bytes
(`Tokenizer.piece_bytes`) into an incremental UTF-8 decoder, which holds an incomplete
sequence back until the rest arrives; so the concatenated output equals `Tokenizer.decode`.

`TextAssembler` is the whole text path of one generated sequence: detokenizing, stop
strings, and resuming after tokens an earlier run already sent (`replay`), so the text goes
on as if the run had never stopped. `Generator` runs one per sequence; nothing else
turns generated tokens into text.
"""

from __future__ import annotations

import codecs
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from runtime.finish import FINISH_STOP
from runtime.stop_strings import StopStringMatcher

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


class TextAssembler:
    """Token ids in, text deltas out, for one sequence that continues a prompt.

    `markers`: control tokens (no text here) whose text a parser reads after this token's
    text (a chat format's markers, `runtime.chat_formats`). The start of a stop string held
    back is released at one, so the parser gets that text before the marker, in the order
    they were generated; a stop string does not match across a marker, as in llama.cpp,
    which renders such tokens as text.
    """

    def __init__(
        self, tokenizer: Tokenizer, stops: Sequence[str], markers: Collection[int] = ()
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._stops = StopStringMatcher(stops)
        self._markers = frozenset(markers)

    def push(self, token_id: int, engine_finish: str | None) -> tuple[str, str | None]:
        """The text this token releases and the sequence's finish reason, if it ends here.

        `engine_finish` is the sampler's verdict: "stop" for a stop token (EOS, end of turn,
        stop_token_ids), which adds no text; "length" for the last allowed token. A stop
        string turns either verdict, or none, into "stop".
        """
        delta = "" if engine_finish == FINISH_STOP else self._detokenizer.push(token_id)
        text, hit_stop = self._stops.push(delta)
        if hit_stop:
            return text, FINISH_STOP
        if engine_finish is not None:
            tail, hit_stop = self._stops.push(self._detokenizer.flush())
            text += tail if hit_stop else tail + self._stops.flush()
            return text, FINISH_STOP if hit_stop else engine_finish
        if token_id in self._markers:
            text += self._stops.flush()
        return text, None

    def replay(self, token_ids: Sequence[int]) -> str:
        """Push tokens already sent (none of which ended the sequence); their text. The
        UTF-8 bytes and stop-string prefixes they leave held back stay held back."""
        return "".join(self.push(t, None)[0] for t in token_ids)
