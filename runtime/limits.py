"""Every limit on a generation request, in one place: the engine enforces them
(`runtime.sampling`, `runtime.request`) and the API's schemas check the same numbers at
submission, so a request is refused with the same words wherever it is caught."""

from __future__ import annotations

MAX_STOP_STRINGS = 4
"""Stop strings per request (OpenAI's limit); each is searched for on every token."""
MAX_STOP_STRING_CHARS = 1000
"""Longest stop string; the matcher holds back up to this many characters of output."""
MAX_LOGPROBS = 20
"""Most alternatives per token that `logprobs` may ask for (OpenAI's limit)."""
MAX_LOGIT_BIAS = 100.0
"""OpenAI's range for a logit_bias value: -100 effectively bans a token, +100 forces it."""
MAX_PENALTY = 2.0
"""OpenAI's range for presence_penalty and frequency_penalty."""
MAX_CHOICES = 64
"""Choices (prompts x n) in one request; each is a sequence in the batch."""
DEFAULT_COMPLETION_TOKENS = 16
"""OpenAI's default max_tokens for /v1/completions."""
MAX_CONSTRAINT_CHARS = 100_000
"""Longest JSON schema (as JSON text), regex or grammar; llguidance compiles it per request."""
