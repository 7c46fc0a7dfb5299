"""`llmq worker`: its options and the handler that runs one worker process.

Added to the `llmq` parser by the front door (`llmq.cli`); argparse only at import time, so
building the parser loads neither RQ's worker nor an engine.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import TypeVar

from runtime.cli_options import add_command
from runtime.devices import DeviceError, parse_device
from runtime.kernels import BACKENDS
from runtime.registry import DEFAULT_MODEL

T = TypeVar("T")


def _csv(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def _device(value: str) -> str:
    """The device's form only: whether this machine can run it is the config's check."""
    try:
        return parse_device(value)
    except DeviceError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_redis_and_log_options(parser: argparse.ArgumentParser) -> None:
    """`--redis-url` and `--log-level`, which `llmq worker` and `llmq webhooks` both take."""
    parser.add_argument(
        "--redis-url", default=None, help="default: $REDIS_URL or redis://127.0.0.1:6379/0"
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="least severe log records written to stderr",
    )


def _log_to_stderr(level: str) -> None:
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )


WORKER_HELP = """run a worker: take jobs from Redis and generate with warm engines

Take jobs for the given models from their RQ queues (interactive before batch), keep the
engines loaded, and step many jobs together, streaming their tokens to Redis. SIGTERM
drains: no new jobs, running ones get --grace seconds, the rest are requeued for another
worker to resume; a second signal requeues at once.
"""


def add_worker_commands(sub: argparse._SubParsersAction) -> None:
    worker = add_command(
        sub,
        "worker",
        WORKER_HELP,
        epilog="Environment: REDIS_URL (or REDIS_SENTINELS, REDIS_MASTER_NAME, REDIS_PASSWORD, "
        "REDIS_DB), LLMQ_MODELS (model registry TOML), "
        "LLMQ_POOL_CAPACITY (models kept loaded, default 2), LLMQ_POOL_MEMORY_MB (memory "
        "budget of the loaded models on each device, default unlimited), LLMQ_DEVICE, "
        "LLMQ_BACKEND.",
    )
    worker.add_argument(
        "--models",
        type=_csv,
        action="extend",
        default=[],
        metavar="M,...",
        help="model ids from the registry or .gguf paths, loaded as the worker starts (as "
        "many as LLMQ_POOL_CAPACITY and LLMQ_POOL_MEMORY_MB allow) (default: every registry "
        f"model; only the default one, {DEFAULT_MODEL}, is loaded at start, the others "
        "when their first job arrives)",
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
        type=_device,
        default=None,
        metavar="cpu|cuda[:N]",
        help="where every served model runs; cuda means cuda:0, and a machine without CUDA "
        "refuses it in one line (default: $LLMQ_DEVICE, else each model's registry "
        "`device`, else cpu)",
    )
    worker.add_argument(
        "--backend",
        choices=BACKENDS,
        default=None,
        help="kernel backend: numpy (exact float32) or torch (quantized weights, compiled "
        "kernels) (default: $LLMQ_BACKEND, else each model's registry entry, else torch)",
    )
    worker.add_argument(
        "--max-batch",
        dest="max_sequences",  # the published flag; inside, one name for the step's sequences
        type=int,
        default=None,
        metavar="N",
        help="sequences generated together, across jobs and models (default: 32 on the "
        "cpu, 256 on a cuda device)",
    )
    worker.add_argument(
        "--kv-memory-mb",
        type=int,
        default=None,
        metavar="MB",
        help="each model's KV cache, in MiB: how many tokens its sequences hold at once "
        "(default: 1024 on the cpu, backed only as used; on a cuda device half the memory "
        "left after the weights); past it the lowest-priority sequences are preempted",
    )
    worker.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        metavar="F",
        help="on a cuda device, the share of the memory left after the weights that each "
        "model's KV pool takes (default: $LLMQ_GPU_MEMORY_UTILIZATION, else 0.5, at most "
        "16 GiB); a pool that cannot hold one sequence of the model's context is refused",
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
        "--nice",
        type=int,
        default=None,
        metavar="N",
        help="run the worker's threads at nice N, 0-19, so that an API and a broker on the "
        "same machine go first when its cores are busy (workers/priority.py) (default: "
        "$LLMQ_WORKER_NICE, else 0; `llmq serve --worker-nice N` starts its workers at N)",
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
    _add_redis_and_log_options(worker)
    worker.set_defaults(handler=run_worker)
    add_webhook_command(sub)


WEBHOOKS_HELP = """deliver webhooks: signed POSTs of response and batch events, with retries

Read the webhook outbox (each notifying job's or batch's end, written with it), enqueue one
RQ job per subscribed endpoint, and deliver them with an RQ SimpleWorker (scheduler on):
Standard Webhooks signatures, retries with backoff for about a day, then the dead-letter
list (GET /admin/webhooks/dead). Run one or more; each restart picks up where it stopped.
"""


def add_webhook_command(sub: argparse._SubParsersAction) -> None:
    webhooks = add_command(
        sub,
        "webhooks",
        WEBHOOKS_HELP,
        epilog="Environment: REDIS_URL (or REDIS_SENTINELS ...), LLMQ_WEBHOOK_ALLOW (hosts "
        "or CIDRs a webhook may reach although private or loopback), "
        "LLMQ_WEBHOOK_TIMEOUT_SECONDS (each POST, default 10), LLMQ_WEBHOOK_RETRY_INTERVALS "
        "(comma-separated seconds between attempts; default 1,2,4,...,2048 then 3600 x 23).",
    )
    _add_redis_and_log_options(webhooks)
    webhooks.set_defaults(handler=run_webhooks)


def run_webhooks(args: argparse.Namespace) -> int:
    from workers.webhooks.process import run_webhooks as run

    _log_to_stderr(args.log_level)
    return _connected(lambda: run(args.redis_url, args.log_level))


def run_worker(args: argparse.Namespace) -> int:
    from workers.config import WorkerConfig
    from workers.worker import LLMQWorker

    _log_to_stderr(args.log_level)
    _lower_priority(args.nice)
    config = WorkerConfig.from_env(
        redis_url=args.redis_url,
        name=args.name,
        models=args.models,
        queues=args.queues,
        device=args.device,
        backend=args.backend,
        max_sequences=args.max_sequences,
        kv_memory_mb=args.kv_memory_mb,
        gpu_memory_utilization=args.gpu_memory_utilization,
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


def _lower_priority(nice: int | None) -> None:
    """Before any engine thread starts (they inherit it): `--nice`, else $LLMQ_WORKER_NICE."""
    from workers.priority import NICE_ENV, lower_threads, worker_nice

    if nice is None and not os.environ.get(NICE_ENV):
        return
    lower_threads(worker_nice(nice))


def _connected(make: Callable[[], T]) -> T:
    """`make()`, retried with backoff while Redis is unreachable: a worker started before
    its broker waits for it instead of exiting (docs/faults.md L6)."""
    from workers.wire.broker import BROKER_LOST

    delay = 0.5
    while True:
        try:
            return make()
        except BROKER_LOST as exc:
            logging.getLogger("llmq.worker").error(
                "Redis unavailable (%s); retry in %gs", exc, delay
            )
            time.sleep(delay)
            delay = min(delay * 2, 10.0)
