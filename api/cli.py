"""`llmq api`: run the HTTP API under gunicorn with api/gunicorn_conf.py."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from runtime.cli_options import add_command, add_listen_options

CONF = Path(__file__).with_name("gunicorn_conf.py")


API_HELP = """serve the HTTP API (gunicorn, gevent)

Serve the OpenAI-compatible HTTP API with gunicorn. Needs Redis (REDIS_URL, or
REDIS_SENTINELS and REDIS_MASTER_NAME) and, to answer requests, at least one `llmq worker`.
"""


def add_api_commands(sub: argparse._SubParsersAction) -> None:
    api = add_command(sub, "api", API_HELP)
    add_listen_options(api)
    api.add_argument(
        "--workers",
        type=int,
        default=int(os.environ.get("LLMQ_API_WORKERS", "2")),
        help="gunicorn processes, each holding thousands of streams (default: 2)",
    )
    api.set_defaults(handler=run_api)


def gunicorn_argv(args: argparse.Namespace) -> list[str]:
    return [
        sys.executable,
        "-m",
        "gunicorn",
        "-c",
        str(CONF),
        "-b",
        f"{args.host}:{args.port}",
        "-w",
        str(args.workers),
        "api.app:create_app()",
    ]


def run_api(args: argparse.Namespace) -> int:
    if args.workers < 1:
        print("llmq api: --workers must be at least 1", file=sys.stderr)
        return 2
    from workers.wire.broker import BrokerConfigError, BrokerSettings

    try:  # REDIS_URL and REDIS_SENTINELS both set: one line now, not a traceback per process
        BrokerSettings.from_env()
    except BrokerConfigError as exc:
        print(f"llmq api: {exc}", file=sys.stderr)
        return 2
    argv = gunicorn_argv(args)
    os.execv(argv[0], argv)  # replaces this process: signals go straight to gunicorn
    return 0  # not reached
