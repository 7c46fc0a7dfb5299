"""Why a sequence stopped: the finish reasons the engine reports, in OpenAI's words.

Its own leaf module because the sampler, the text path (`runtime.detokenizer`) and the
generator all name them, and none of them should load another to do so.
"""

from __future__ import annotations

FINISH_STOP = "stop"
"""EOS, a stop string, or a grammar that is complete."""
FINISH_LENGTH = "length"
"""`max_tokens` reached."""
FINISH_ERROR = "error"
"""The engine ended the sequence on a fault of its own (`TokenEvent.error` says which)."""
