"""The `llmq` command line: every subcommand, each group added by its own package.

`build_parser` collects the groups in `COMMAND_GROUPS`; a package adds its commands with an
`add_*_commands(sub)` function and each command sets `handler` (args -> exit code).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from api.batch_cli import add_batch_commands
from api.cli import add_api_commands
from runtime.cli import add_runtime_commands
from runtime.errors import LLMQRuntimeError
from workers.errors import WorkerError
from workers.supervisor import add_serve_commands

T = TypeVar("T")


def _csv(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def add_worker_commands(sub: argparse._SubParsersAction) -> None:
    worker = sub.add_parser(
        "worker",
        help="run a worker: take jobs from Redis and generate with warm engines",
        description="Take jobs for the given models from their RQ queues (interactive before "
        "batch), keep the engines loaded, and run many jobs in one batch, streaming their "
        "tokens to Redis. SIGTERM drains: no new jobs, running ones get --grace seconds, the "
        "rest are requeued for another worker to resume; a second signal requeues at once.",
        epilog="Environment: REDIS_URL, LLMQ_MODELS (model registry TOML), "
        "LLMQ_POOL_CAPACITY (models kept loaded, default 2), LLMQ_POOL_MEMORY_MB (memory "
        "budget of the loaded models, default unlimited).",
    )
    worker.add_argument(
        "--models",
        type=_csv,
        action="extend",
        default=[],
        metavar="M,...",
        help="model ids from the registry or .gguf paths (default: every registry model, "
        "loaded when its first job arrives)",
    )
    worker.add_argument(
        "--queues",
        type=_csv,
        action="extend",
        default=[],
        metavar="Q,...",
        help="RQ queue names (llmq-{model}-interactive|batch) or the kinds 'interactive' "
        "and 'batch' (default: both kinds of every served model)",
    )
    worker.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="accepted for compatibility; the numpy engine runs on the CPU",
    )
    worker.add_argument(
        "--max-batch",
        type=int,
        default=8,
        metavar="N",
        help="sequences generated together, across jobs and models (default: 8)",
    )
    worker.add_argument("--name", help="worker name (default: HOST.PID); unique per worker")
    worker.add_argument(
        "--grace",
        type=float,
        default=25.0,
        metavar="SECONDS",
        help="on SIGTERM, how long running jobs may take to finish before they are "
        "checkpointed and requeued (default: 25)",
    )
    worker.add_argument(
        "--poll-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="longest idle wait between looks at the queues; a newly queued job wakes the "
        "worker at once, so this only bounds jobs queued without a wake-up (default: 0.05, "
        "at most 4)",
    )
    worker.add_argument(
        "--redis-url", default=None, help="default: $REDIS_URL or redis://127.0.0.1:6379/0"
    )
    worker.add_argument(
        "--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR")
    )
    worker.set_defaults(handler=run_worker)


def run_worker(args: argparse.Namespace) -> int:
    from workers.config import WorkerConfig
    from workers.worker import LLMQWorker

    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    config = WorkerConfig.from_env(
        redis_url=args.redis_url,
        name=args.name,
        models=args.models,
        queues=args.queues,
        device=args.device,
        max_batch=args.max_batch,
        grace=args.grace,
        poll_interval=args.poll_interval,
    )
    worker = _connected(lambda: LLMQWorker(config))
    try:
        worker.start()
    except ValueError as exc:  # RQ: a live worker already has this name
        print(f"llmq worker: {exc}", file=sys.stderr)
        return 2
    worker.work()
    return 0


def _connected(make: Callable[[], T]) -> T:
    """`make()`, retried with backoff while Redis is unreachable: a worker started before
    its broker waits for it instead of exiting (RELIABILITY 6)."""
    import redis

    delay = 0.5
    while True:
        try:
            return make()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            logging.getLogger("llmq.worker").error(
                "Redis unavailable (%s); retry in %gs", exc, delay
            )
            time.sleep(delay)
            delay = min(delay * 2, 10.0)


# `api.cli` is argparse only (it execs gunicorn); importing it loads neither Flask nor models.
COMMAND_GROUPS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    add_runtime_commands,
    add_worker_commands,
    add_api_commands,
    add_serve_commands,
    add_batch_commands,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmq", description="Serve GGUF language models through a Redis job queue."
    )
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
