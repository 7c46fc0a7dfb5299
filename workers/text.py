"""Generated text of one choice, assembled from token ids in the worker.

The worker, not the engine, turns tokens into text (with runtime's own incremental
detokenizer and stop-string matcher, applied exactly as `BatchGenerator` applies them), so
a job resumed by another worker can first *replay* the tokens already streamed: the UTF-8
bytes and stop-string prefixes held back at the moment the first worker died are restored,
and the stream goes on as if it had never stopped. The engine runs without stop strings;
when one is hit here the worker aborts the sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

from runtime.detokenizer import IncrementalDetokenizer
from runtime.stop_strings import StopStringMatcher
from runtime.tokenizer import Tokenizer

FINISH_STOP, FINISH_LENGTH = "stop", "length"


class TextAssembler:
    """Token ids in, text deltas out, for one sequence that continues a prompt."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str]) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._stops = StopStringMatcher(stops)

    def push(self, token_id: int, engine_finish: str | None) -> tuple[str, str | None]:
        """The text this token releases and the choice's finish reason, if it ends here.

        `engine_finish` is the engine's own verdict: "stop" for a stop token (EOS, end of
        turn, stop_token_ids), which adds no text; "length" for the last allowed token.
        """
        delta = "" if engine_finish == FINISH_STOP else self._detokenizer.push(token_id)
        text, hit_stop = self._stops.push(delta)
        if hit_stop:
            return text, FINISH_STOP
        if engine_finish is not None:
            tail, hit_stop = self._stops.push(self._detokenizer.flush())
            text += tail if hit_stop else tail + self._stops.flush()
            return text, FINISH_STOP if hit_stop else engine_finish
        return text, None

    def replay(self, token_ids: Sequence[int]) -> str:
        """Push tokens already sent (none of which ended the choice); their text."""
        return "".join(self.push(t, None)[0] for t in token_ids)
