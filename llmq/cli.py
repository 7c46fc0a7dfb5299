"""The `llmq` command line: every subcommand, each group added by the room that owns it.

`build_parser` collects the groups in `COMMAND_GROUPS`; a room adds its commands with an
`add_*_commands(sub)` function and each command sets `handler` (args -> exit code). The
groups' modules are argparse only: importing them loads neither Flask nor a model.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version

from api.batches.cli import add_batch_commands
from api.cli import add_api_commands
from runtime.cli import add_runtime_commands
from runtime.errors import LLMQRuntimeError
from workers.cli import add_worker_commands
from workers.errors import WorkerError
from workers.supervisor import add_serve_commands

COMMAND_GROUPS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    add_runtime_commands,
    add_worker_commands,
    add_api_commands,
    add_serve_commands,
    add_batch_commands,
)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)" suffix, left off where it would mislead: where the help
    already says its default in words (an environment variable, a computed value), and for
    flags and unset options, whose "False" or "None" says nothing a user can act on."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, [], "") or "default" in (action.help or "").lower():
            return action.help
        return super()._get_help_string(action)


class LLMQParser(argparse.ArgumentParser):
    """Every `llmq` (sub)command shows its defaults: `add_subparsers` builds subcommand
    parsers of the parent's class, so setting the formatter here reaches them all."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]


def llmq_version() -> str:
    """The installed distribution's version (pyproject.toml's, via the package metadata)."""
    try:
        return version("llmq")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = LLMQParser(
        prog="llmq", description="Serve GGUF language models through a Redis job queue."
    )
    parser.add_argument("--version", action="version", version=f"llmq {llmq_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_commands in COMMAND_GROUPS:
        add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (LLMQRuntimeError, WorkerError) as exc:
        print(f"llmq: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
