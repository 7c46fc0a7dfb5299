"""The tokens a request may use, reckoned at submission: what `LLMQ_RATE_LIMIT_TPM` reserves.

A generation reserves its prompt tokens plus the most it may generate: `max_tokens` for
each choice of each prompt, or for chat without `max_tokens` what the context leaves, as
the worker plans it (`workers.requests`), though never more than the whole limit (a chat
that did not ask for a context's worth of tokens is not refused as too large for it; it
waits for a full bucket). Embeddings reserve their input tokens. The
prompt is counted with the model's own tokenizer where this machine has the model (the
count `api.flow.check_context` has already made), else estimated at 4 characters a token
(OpenAI's rule of thumb). The job's end settles the reservation to the tokens it really
used (`workers.wire.rate_limit`), so an estimate only matters while the job runs.
"""

from __future__ import annotations

import json
import math
from typing import Any

from runtime.errors import LLMQRuntimeError
from runtime.limits import DEFAULT_COMPLETION_TOKENS
from runtime.model_text import ModelText
from runtime.request import GenerationSpec, prompt_list

CHARS_PER_TOKEN = 4


def reserved_tokens(
    spec: GenerationSpec, prompt_tokens: int | None, context: int | None, limit: int
) -> int:
    """Prompt tokens (`prompt_tokens` when counted, else estimated) + the most `spec` may
    generate; `context`, the model's context length, bounds chat without max_tokens, and
    so does `limit`, the tokens-per-minute limit."""
    if prompt_tokens is None:
        prompt_tokens = _estimate_prompt(spec)
    if spec.max_tokens is not None:
        return prompt_tokens + spec.n * spec.max_tokens * len(spec.prompts or [None])
    most = DEFAULT_COMPLETION_TOKENS  # a model that published no context length
    if context is not None:
        most = max(1, context - prompt_tokens)
    return min(prompt_tokens + spec.n * most, max(limit, prompt_tokens))


def embedding_tokens(value: Any, text: ModelText | None) -> int:
    """The tokens of an embeddings `input` (any of OpenAI's four forms)."""
    try:
        items = prompt_list(value, "input")
    except LLMQRuntimeError:
        return 1  # refused by the worker with its own words; a request still costs a token
    total = 0
    for item in items:
        if isinstance(item, list):
            total += len(item)
            continue
        try:
            total += len(text.encode(str(item))) if text is not None else _estimate(str(item))
        except LLMQRuntimeError:
            total += _estimate(str(item))
    return max(1, total)


def _estimate_prompt(spec: GenerationSpec) -> int:
    if spec.chat:
        shown = json.dumps([spec.messages, spec.prompt_tools], ensure_ascii=False)
        return _estimate(shown)
    return sum(len(p) if isinstance(p, list) else _estimate(p) for p in spec.prompts or [])


def _estimate(text: str) -> int:
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))
