"""The models' text sides (`runtime.model_text.ModelText`) an API process checks requests
with: tokenizer and chat template, read from the GGUF header of a model this machine has.

A model the API cannot find here (workers on other machines serving files this one lacks)
is not checked here: its worker still checks it and fails the job with the same 400. A
model that is found is loaded once per process (a few hundred ms; Gemma's 262k-token
vocabulary about a second) and kept: the text side holds no weights.
"""

from __future__ import annotations

import logging
import threading

from runtime.errors import LLMQRuntimeError
from runtime.model_text import ModelText

log = logging.getLogger("llmq.api")


class ModelTexts:
    """Model id -> its text side, or None where this machine has no such model."""

    def __init__(self) -> None:
        self._loaded: dict[str, ModelText | None] = {}
        self._lock = threading.Lock()

    def get(self, model: str) -> ModelText | None:
        with self._lock:  # one load per model, however many requests ask at once
            if model not in self._loaded:
                self._loaded[model] = _load(model)
            return self._loaded[model]


def _load(model: str) -> ModelText | None:
    try:
        text = ModelText.load(model)
    except (LLMQRuntimeError, OSError) as exc:
        log.info("model %s: requests are checked by its workers only (%s)", model, exc)
        return None
    log.info("model %s: tokenizer and chat template read for checking requests", model)
    return text
