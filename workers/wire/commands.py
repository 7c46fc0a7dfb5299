"""Admin commands for one worker, pushed on `keys.worker_commands(name)` by the API."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from workers import keys
from workers.wire.text import as_str

COMMAND_LOAD, COMMAND_UNLOAD, COMMAND_ADAPTERS = "load", "unload", "adapters"
COMMANDS = (COMMAND_LOAD, COMMAND_UNLOAD, COMMAND_ADAPTERS)
COMMANDS_TTL_SECONDS = 3600  # a dead worker's command list does not outlive it by much


@dataclass(frozen=True, slots=True)
class AdminCommand:
    """A command about one model for one worker: JSON `{"op", "model"}` on the wire.

    `load` starts loading the model into that worker's pool (evicting an idle model if the
    pool is full); `unload` drops it now, or as soon as its last sequence ends. The outcome
    shows in the worker's `WorkerInfo.pool` within a heartbeat (loading -> ready | failed).
    `adapters` makes the worker load and unload the model's adapters as `keys.LORAS` says
    now rather than at its next heartbeat (`POST /admin/loras` waits for the outcome, which
    the worker publishes at once: `WorkerInfo.pool[model]["loras"]`).
    """

    op: str
    model: str

    def __post_init__(self) -> None:
        if self.op not in COMMANDS:
            raise ValueError(f"op must be one of {', '.join(COMMANDS)}, got {self.op!r}")
        if not isinstance(self.model, str):
            raise ValueError(f"model must be a string, got {self.model!r}")

    def encode(self) -> str:
        """The one encoder."""
        return json.dumps({"op": self.op, "model": self.model})

    @classmethod
    def decode(cls, raw: bytes | str) -> AdminCommand:
        """The one decoder; ValueError if `raw` is not a command."""
        try:
            data = json.loads(as_str(raw))
            return cls(data["op"], data["model"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"not an admin command: {as_str(raw)[:80]!r}") from exc


def encode_command(op: str, model: str) -> str:
    """`AdminCommand(op, model).encode()`; ValueError for an unknown op."""
    return AdminCommand(op, model).encode()


def decode_command(raw: bytes | str) -> tuple[str, str]:
    """(op, model) of an admin command; ValueError if it is not one."""
    command = AdminCommand.decode(raw)
    return command.op, command.model


def push_command(pipe: Any, worker: str, op: str, model: str) -> None:
    """Queue on `pipe` the command for `worker`; an idle worker wakes at once (it blocks on
    its command list), a busy one reads it between steps."""
    key = keys.worker_commands(worker)
    pipe.lpush(key, encode_command(op, model))
    pipe.expire(key, COMMANDS_TTL_SECONDS)
