"""Admin commands for one worker, pushed on `keys.worker_commands(name)` by the API."""

from __future__ import annotations

import json

from workers.wire.text import as_str

COMMAND_LOAD, COMMAND_UNLOAD = "load", "unload"


def encode_command(op: str, model: str) -> str:
    """An admin command for `keys.worker_commands(name)`: JSON `{"op", "model"}`.

    `load` starts loading the model into that worker's pool (evicting an idle model if the
    pool is full); `unload` drops it now, or as soon as its last sequence ends. The outcome
    shows in the worker's `WorkerInfo.pool` within a heartbeat (loading -> ready | failed).
    """
    if op not in (COMMAND_LOAD, COMMAND_UNLOAD):
        raise ValueError(f"op must be {COMMAND_LOAD!r} or {COMMAND_UNLOAD!r}, got {op!r}")
    return json.dumps({"op": op, "model": model})


def decode_command(raw: bytes | str) -> tuple[str, str]:
    """(op, model) of an admin command; ValueError if it is not one."""
    try:
        data = json.loads(as_str(raw))
        op, model = data["op"], data["model"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"not an admin command: {as_str(raw)[:80]!r}") from exc
    if op not in (COMMAND_LOAD, COMMAND_UNLOAD) or not isinstance(model, str):
        raise ValueError(f"not an admin command: {as_str(raw)[:80]!r}")
    return op, model
