"""Prompt-prefix digests: how the API sends a request to the worker whose prefix cache holds
its head (`workers.affinity`)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from workers.wire.defaults import PREFIX_DIGEST_CHARS, PREFIX_DIGEST_MIN_CHARS
from workers.wire.job import CHAT_COMPLETIONS, COMPLETIONS


def prefix_digest(endpoint: str, request: dict[str, Any]) -> str | None:
    """A short hash of the part of a request that later requests are likely to share, so
    the API can send them to the worker whose prefix cache holds it (`workers.affinity`).

    Chat: the messages before the last user message (system prompt and history), or the
    head of the first message when nothing comes before it. Completions: the head of the
    prompt. None where routing would not pay: embeddings, lists of prompts, short prefixes.
    """
    if endpoint == CHAT_COMPLETIONS:
        material = _chat_prefix(request.get("messages"))
    elif endpoint == COMPLETIONS and isinstance(request.get("prompt"), str):
        material = [["prompt", request["prompt"][:PREFIX_DIGEST_CHARS], None]]
    else:
        return None
    if material is None or sum(len(text) for _, text, _ in material) < PREFIX_DIGEST_MIN_CHARS:
        return None
    # ensure_ascii (the default) keeps lone surrogates, which JSON bodies may carry, hashable
    canonical = json.dumps([endpoint, material], separators=(",", ":"))
    return hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()


def continuation_digest(endpoint: str, request: dict[str, Any], reply: str) -> str | None:
    """The `prefix_digest` of this conversation's next turn, if the client sends `reply` back
    as the assistant message (the worker's prefix cache then holds that whole history)."""
    if endpoint != CHAT_COMPLETIONS or not isinstance(request.get("messages"), list):
        return None
    turn = [{"role": "assistant", "content": reply}, {"role": "user", "content": ""}]
    return prefix_digest(endpoint, {"messages": [*request["messages"], *turn]})


def _chat_prefix(messages: Any) -> list[list[Any]] | None:
    """[role, content, name] of the messages before the last user message."""
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, dict) for m in messages)
    ):
        return None
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    last = users[-1] if users else len(messages) - 1
    shared = messages[:last] or [messages[0]]
    out = [[m.get("role"), str(m.get("content") or ""), m.get("name")] for m in shared]
    if not messages[:last]:
        out[0][1] = out[0][1][:PREFIX_DIGEST_CHARS]
    return out
