"""Command-line options that commands of more than one room share.

`llmq api` (api/cli.py) and `llmq serve` (workers/supervisor.py) both take `--host` and
`--port`, with the environment defaults of api/gunicorn_conf.py. They live here, in the
lowest room, because `api/` and `workers/` may both import `runtime/` but not each other
(docs/architecture.md); argparse and os only, so importing it loads no engine.
"""

from __future__ import annotations

import argparse
import os


def add_listen_options(parser: argparse.ArgumentParser) -> None:
    """Adds `--host` ($HOST, else 127.0.0.1) and `--port` ($PORT, else 8000) to `parser`."""
    parser.add_argument(
        "--host", default=os.environ.get("HOST", "127.0.0.1"), help="default: $HOST or 127.0.0.1"
    )
    parser.add_argument(
        "--port",
        type=int,
        default=int(os.environ.get("PORT", "8000")),
        help="default: $PORT or 8000",
    )


def add_command(
    sub: argparse._SubParsersAction, name: str, text: str, epilog: str | None = None
) -> argparse.ArgumentParser:
    """Adds the subcommand `name`, described by `text`: its first paragraph is the line
    `llmq --help` lists it with, the rest (joined into one paragraph, as argparse wraps it)
    what `llmq NAME --help` says of it. The texts sit beside each command's module so that
    what the command does and what its help says are read together."""
    summary, _, details = text.strip().partition("\n\n")
    description = " ".join(details.split()) or summary
    return sub.add_parser(name, help=summary, description=description, epilog=epilog)
