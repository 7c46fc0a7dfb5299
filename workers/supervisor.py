"""`llmq serve`: the whole system in one command: a broker, the API and N workers.

The broker is `REDIS_URL` when set; else a `redis-server` found on PATH, started on a free
loopback port; else an embedded fakeredis server in this process (not durable, and said
so). The API and the workers run as child processes (`llmq api`, `llmq worker`), restarted
if they die (RELIABILITY 6: workers must run under a supervisor). Ctrl-C or SIGTERM stops
every process this command started: children get SIGTERM (workers drain), then SIGKILL
after a grace period.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger("llmq.serve")

RESTART_BACKOFF_SECONDS = (1, 2, 5, 10)
STOP_GRACE_SECONDS = 30


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1
    models: list[str] = field(default_factory=list)
    max_batch: int | None = None
    redis_url: str | None = None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class Broker:
    """The Redis this system talks to, started here when the user gave none."""

    def __init__(self, url: str | None) -> None:
        self.url = url
        self.process: subprocess.Popen | None = None
        self._fake_server = None
        self.kind = "external"

    def start(self) -> str:
        if self.url:
            log.info("broker: REDIS_URL (%s)", _redact(self.url))
            return self.url
        port = free_port()
        server = shutil.which("redis-server")
        if server:
            self.process = subprocess.Popen(
                [
                    server,
                    "--port",
                    str(port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--protected-mode",
                    "yes",
                ],
                stdout=subprocess.DEVNULL,
                start_new_session=True,
            )
            self.kind = "redis-server"
            log.info("broker: redis-server on 127.0.0.1:%d (no persistence)", port)
        else:
            from fakeredis import TcpFakeServer

            self._fake_server = TcpFakeServer(("127.0.0.1", port), server_type="redis")
            threading.Thread(target=self._fake_server.serve_forever, daemon=True).start()
            self.kind = "fakeredis"
            log.warning(
                "broker: embedded fakeredis on 127.0.0.1:%d - NOT DURABLE, jobs are lost when "
                "this process stops; set REDIS_URL or install redis-server for real use",
                port,
            )
        self.url = f"redis://127.0.0.1:{port}/0"
        wait_for_port(port)
        return self.url

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
        if self._fake_server is not None:
            self._fake_server.shutdown()
            self._fake_server.server_close()  # the listening socket, which shutdown() keeps


@dataclass
class Child:
    """A supervised process: restarted with backoff when it exits on its own."""

    name: str
    argv: list[str]
    env: dict[str, str]
    process: subprocess.Popen | None = None
    restarts: int = 0
    next_start: float = 0.0

    def start(self) -> None:
        log.info("starting %s", self.name)
        # own session: a Ctrl-C in the terminal reaches the supervisor, which stops children
        self.process = subprocess.Popen(self.argv, env=self.env, start_new_session=True)

    def poll(self) -> None:
        if self.process is None or self.process.poll() is None:
            return
        code = self.process.returncode
        self.process = None
        delay = RESTART_BACKOFF_SECONDS[min(self.restarts, len(RESTART_BACKOFF_SECONDS) - 1)]
        self.restarts += 1
        self.next_start = time.monotonic() + delay
        log.warning("%s exited with %s; restarting in %ds", self.name, code, delay)

    def maybe_restart(self) -> None:
        if self.process is None and time.monotonic() >= self.next_start:
            self.start()

    def signal(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                pass


def llmq_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "llmq", *args]


def serve(config: ServeConfig) -> int:
    broker = Broker(config.redis_url or os.environ.get("REDIS_URL"))
    url = broker.start()
    env = {**os.environ, "REDIS_URL": url, "HOST": config.host, "PORT": str(config.port)}
    children = [
        Child("api", llmq_command("api", "--host", config.host, "--port", str(config.port)), env)
    ]
    worker_args = ["worker"]
    if config.models:
        worker_args += ["--models", ",".join(config.models)]
    if config.max_batch:
        worker_args += ["--max-batch", str(config.max_batch)]
    for i in range(config.workers):
        children.append(Child(f"worker-{i}", llmq_command(*worker_args), env))

    stopping = threading.Event()

    def request_stop(signum: int, _frame: object) -> None:
        log.info("received %s: stopping every process", signal.Signals(signum).name)
        stopping.set()

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    for child in children:
        child.start()
    log.info("llmq is serving on http://%s:%d (broker: %s)", config.host, config.port, broker.kind)
    try:
        while not stopping.wait(0.5):
            for child in children:
                child.poll()
                child.maybe_restart()
    finally:
        _stop_children(children)
        broker.stop()
    return 0


def _stop_children(children: list[Child]) -> None:
    for child in children:
        child.signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for child in children:
        if child.process is None:
            continue
        try:
            child.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %ds; killing it", child.name, STOP_GRACE_SECONDS)
            child.signal(signal.SIGKILL)
            child.process.wait()


def wait_for_port(port: int, timeout: float = 10.0) -> None:
    """Block until something accepts connections on 127.0.0.1:`port`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port} after {timeout:g}s")


def _redact(url: str) -> str:
    """Hide a password in a Redis URL before logging it."""
    if "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    return f"{scheme}://***@{rest.split('@', 1)[1]}"


def add_serve_commands(sub: argparse._SubParsersAction) -> None:
    serve_parser = sub.add_parser(
        "serve",
        help="run everything: broker, API and workers (what `make serve` runs)",
        description="Run the whole system: the API on http://HOST:PORT and N workers, "
        "against REDIS_URL if set, else a redis-server started on a free port, else an "
        "embedded fakeredis server (not durable). Ctrl-C stops every process it started.",
    )
    serve_parser.add_argument(
        "--host", default=os.environ.get("HOST", "127.0.0.1"), help="default: $HOST or 127.0.0.1"
    )
    serve_parser.add_argument(
        "--port",
        type=int,
        default=int(os.environ.get("PORT", "8000")),
        help="default: $PORT or 8000",
    )
    serve_parser.add_argument("--workers", type=int, default=1, help="worker processes")
    serve_parser.add_argument(
        "--models",
        default="",
        metavar="M,...",
        help="models the workers serve (default: every registry model, loaded on first use)",
    )
    serve_parser.add_argument(
        "--max-batch", type=int, help="sequences each worker steps together (default: 32)"
    )
    serve_parser.set_defaults(handler=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.workers < 1:
        print("llmq serve: --workers must be at least 1", file=sys.stderr)
        return 2
    config = ServeConfig(
        host=args.host,
        port=args.port,
        workers=args.workers,
        models=[m.strip() for m in args.models.split(",") if m.strip()],
        max_batch=args.max_batch,
    )
    return serve(config)
