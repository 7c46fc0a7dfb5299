"""Named exceptions of the runtime. Every error a user can cause has a class here.

Messages say what was wrong and what was expected, so a CLI or API can show them as-is.
"""

from __future__ import annotations


class LLMQRuntimeError(Exception):
    """Base of every error the engine raises on purpose."""


class ModelNotFoundError(LLMQRuntimeError):
    """A model id or path that the registry cannot resolve to a GGUF file."""


class ModelFormatError(LLMQRuntimeError):
    """A GGUF file that is corrupt, truncated, or uses an unsupported architecture or type."""


class ContextLengthError(LLMQRuntimeError):
    """Prompt plus requested tokens do not fit the model's context window."""


class EmptyPromptError(LLMQRuntimeError):
    """A prompt with no tokens to condition on."""


class InvalidSamplingParams(LLMQRuntimeError, ValueError):
    """A sampling option out of range or of the wrong type; the message names field and value."""
