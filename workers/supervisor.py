"""`llmq serve`: the whole system in one command: a broker, the API and N workers.

The broker is the master `REDIS_SENTINELS` name, or `REDIS_URL`; else a real redis-server
(the one on PATH, else the one installed with llmq: workers/redis_server.py) started on a free
loopback port, keeping its data under `LLMQ_CACHE_DIR`, so that queued and running jobs,
batches and their files survive a stop and a restart of `llmq serve`. The API and the
workers run as child processes (`llmq api`, `llmq worker`), restarted if they die
(docs/faults.md L6: workers must run under a supervisor). Ctrl-C, SIGTERM or SIGHUP (a closed
terminal) stops every process this command started: children get SIGTERM (workers drain),
then SIGKILL after a grace period.

A kill -9 of this process does the same, a little faster: every child runs under a keeper
(workers/child_death.py) that stops it and what it started once serve is gone. A restart
then comes up on the same data: what an earlier serve of the same folder left running anyway
is found and stopped first (workers/leftovers.py), a broker on its data folder above all.

What a user sees must be true: a port already taken is refused before anything starts
(as vLLM and llama.cpp do); "serving" is printed once `/ready` answers, with the models
ready; and a child that fails as soon as it starts, `GIVE_UP_AFTER` times in a row, stops
everything with its last lines of stderr instead of being restarted for ever.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from runtime.cache_dir import CACHE_ENV, cache_dir
from runtime.cli_options import add_command, add_listen_options
from workers import leftovers
from workers.child_death import keeper_argv
from workers.errors import ServeError
from workers.leftovers import SERVED_BY_ENV
from workers.priority import WORKER_NICE, lower_session, worker_nice
from workers.redis_server import RedisServerMissing, RedisServerProcess, find_redis_server

log = logging.getLogger("llmq.serve")

RESTART_BACKOFF_SECONDS = (1, 2, 5, 10)
STOP_GRACE_SECONDS = 30  # a child's keeper SIGKILLs its group this long after SIGTERM
KEEPER_SLACK_SECONDS = 10  # serve kills a keeper that has not ended this long after that
# serve is gone: its children's keepers SIGTERM them and SIGKILL what is left this much later
# (the broker fsyncs in milliseconds; a worker whose broker died with serve only waits here)
ORPHAN_GRACE_SECONDS = 10
WORKER_AGAIN_SECONDS = 1  # ... and a worker gets a second SIGTERM: checkpoint, do not drain
BROKER_STOP_SECONDS = 10  # RedisServerProcess.stop's own wait before SIGKILL
FAST_EXIT_SECONDS = 30.0  # a child that exits sooner than this after its start failed at once
GIVE_UP_AFTER = 3  # consecutive fast exits of one child after which serve stops everything
STDERR_TAIL_LINES = 15  # a child's last stderr lines kept, to say why it gave up
READY_POLL_SECONDS = 0.5
BROKER_DIR_ENV = "LLMQ_BROKER_DIR"  # where the embedded broker keeps its data (broker_dir)


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1
    models: list[str] = field(default_factory=list)
    max_sequences: int | None = None
    redis_url: str | None = None
    device: str | None = None  # every worker's --device; None: $LLMQ_DEVICE, else per model
    durable: bool = True  # the embedded broker keeps its data (--no-persist: it does not)
    worker_nice: int = WORKER_NICE  # the workers' priority below the API's (workers/priority.py)

    def broker_dir(self) -> Path | None:
        """Where the embedded broker keeps its append-only file: `LLMQ_BROKER_DIR`, else one
        directory per API port under `LLMQ_CACHE_DIR`, so that the llmq serve on a port finds
        its own queued jobs again after a restart."""
        if not self.durable:
            return None
        if os.environ.get(BROKER_DIR_ENV):
            return Path(os.environ[BROKER_DIR_ENV])
        return cache_dir() / "broker" / f"serve-{self.port}"

    def home(self) -> Path:
        """The folder that holds this serve's lock and names its processes (SERVED_BY_ENV):
        its broker's folder, else the one a durable serve on this port would use."""
        return self.broker_dir() or cache_dir() / "broker" / f"serve-{self.port}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class Broker:
    """The Redis this system talks to: the user's (`REDIS_URL`, Sentinel), else a real
    redis-server started here (workers/redis_server.py), durable under `data_dir`."""

    def __init__(
        self, url: str | None, sentinel: str | None = None, data_dir: Path | None = None
    ) -> None:
        self.url = url
        self.sentinel = sentinel  # where the Sentinels are, when they name the master
        self.data_dir = data_dir  # the embedded broker's append-only file; None: not saved
        self.server: RedisServerProcess | None = None
        self._lock: IO[str] | None = None
        self.kind = "external"

    def start(self) -> str | None:
        """The URL the children get as REDIS_URL; None when they find the master through
        Sentinel (they read REDIS_SENTINELS from the same environment)."""
        if self.sentinel:
            self.kind = "sentinel"
            log.info("broker: %s", self.sentinel)
            return None
        if self.url:
            from workers.wire.broker import redact

            log.info("broker: REDIS_URL (%s)", redact(self.url))
            return self.url
        try:
            binary = find_redis_server()
        except RedisServerMissing as exc:
            raise ServeError(str(exc)) from None
        data_dir = None
        if self.data_dir is not None:
            # a directory per major version: Redis 7's append-only files are not Redis 6's
            data_dir = self.data_dir / f"redis{binary.version[0]}"
            self._lock = hold_lock(data_dir)
            # the lock is ours, so a server still writing there belongs to a serve that died
            leftovers.stop(leftovers.redis_servers_in(data_dir), BROKER_STOP_SECONDS, "the broker")
        self.server = KeptRedisServer(binary, free_port(), data_dir)
        try:
            self.url = self.server.start()
        except RedisServerMissing as exc:
            raise ServeError(str(exc)) from None
        self.kind = binary.describe()
        if data_dir is None:
            log.info("broker: %s on %s (nothing saved)", self.kind, self.url)
        else:
            log.info("broker: %s on %s, jobs kept in %s", self.kind, self.url, data_dir)
        return self.url

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self._lock is not None:
            self._lock.close()  # closing the file releases its lock


class KeptRedisServer(RedisServerProcess):
    """The embedded redis-server under a keeper (workers/child_death.py): it stops with
    SIGTERM, writing and fsyncing its append-only file, when serve is killed. The keeper
    passes RedisServerProcess.stop's SIGTERM on, and its SIGKILL takes the server along."""

    def argv(self) -> list[str]:
        return keeper_argv(
            super().argv(), grace=BROKER_STOP_SECONDS, orphan_grace=ORPHAN_GRACE_SECONDS
        )


def hold_lock(directory: Path, name: str = "llmq-serve.lock") -> IO[str]:
    """Lock `directory` for this process (two servers must never write one append-only
    file); raises ServeError when another llmq serve holds it. The lock lasts as long as
    the returned file stays open, and ends with the process however it ends (the file is
    opened close-on-exec: no child holds it after serve is gone)."""
    directory.mkdir(parents=True, exist_ok=True)
    lock = (directory / name).open("w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise ServeError(
            f"another llmq serve keeps its broker's data in {directory}: stop it, or give "
            f"this one another {CACHE_ENV} or REDIS_URL"
        ) from None
    return lock


@dataclass
class Child:
    """A supervised process: restarted with backoff when it exits on its own. Its stderr
    passes through this process line by line, and the last lines are kept."""

    name: str
    argv: list[str]
    env: dict[str, str]
    again: float = 0.0  # when serve is gone: a second SIGTERM this long after the first
    nice: int = 0  # its session's priority below the API's (workers/priority.py)
    process: subprocess.Popen | None = None
    restarts: int = 0
    next_start: float = 0.0
    started_at: float = 0.0
    fast_exits: int = 0  # consecutive exits within FAST_EXIT_SECONDS of the start
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=STDERR_TAIL_LINES))
    _relay: threading.Thread | None = field(default=None, repr=False)

    def start(self) -> None:
        log.info("starting %s", self.name)
        self.tail.clear()
        # own session: a Ctrl-C in the terminal reaches the supervisor, which stops children;
        # the keeper stops the child and its group if serve dies (workers/child_death.py)
        argv = keeper_argv(
            self.argv, grace=STOP_GRACE_SECONDS, orphan_grace=ORPHAN_GRACE_SECONDS, again=self.again
        )
        self.process = subprocess.Popen(
            argv,
            env=self.env,
            start_new_session=True,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
        )
        self.started_at = time.monotonic()
        if self.nice:  # its keeper leads the session: the child shares its autogroup
            lower_session(self.process.pid, self.nice)
        assert self.process.stderr is not None
        self._relay = threading.Thread(
            target=self._pass_on, args=(self.process.stderr,), daemon=True
        )
        self._relay.start()

    def _pass_on(self, pipe: IO[str]) -> None:
        with pipe:
            for line in pipe:
                self.tail.append(line.rstrip("\n"))
                try:
                    sys.stderr.write(line)
                    sys.stderr.flush()
                except (OSError, ValueError):
                    pass  # the terminal is gone: keep reading, or the child blocks on a full pipe

    def poll(self) -> None:
        """Notice an exit and schedule the restart; raises ServeError when the child has
        failed at once `GIVE_UP_AFTER` times in a row."""
        if self.process is None or self.process.poll() is None:
            return
        code = self.process.returncode
        self.process = None
        if self._relay is not None:
            self._relay.join(2)  # its last lines, which say why it exited
        lived = time.monotonic() - self.started_at
        self.fast_exits = self.fast_exits + 1 if lived < FAST_EXIT_SECONDS else 0
        if self.fast_exits >= GIVE_UP_AFTER:
            last = "\n".join(f"  {line}" for line in self.tail) or "  (nothing on stderr)"
            raise ServeError(
                f"{self.name} exited with {code} within {FAST_EXIT_SECONDS:g}s of its start, "
                f"{self.fast_exits} times in a row; giving up. Its last lines:\n{last}"
            )
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


def check_port_free(host: str, port: int) -> None:
    """Raise ServeError if something already listens on host:port. Bound with SO_REUSEADDR,
    as gunicorn binds: a port left in TIME_WAIT by a server that just stopped is free."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.create_server((host, port), family=family):
            pass
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
        raise ServeError(
            f"cannot listen on {host}:{port}: address already in use. Is another llmq serve "
            "running? Stop it, or choose another port with --port or PORT."
        ) from None


def local_url(host: str, port: int) -> str:
    """Where this machine reaches a server bound to host:port (0.0.0.0 -> 127.0.0.1)."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def readiness(base_url: str) -> tuple[int, dict]:
    """(HTTP status of GET /ready, its JSON body); (0, {}) while the API does not answer."""
    try:
        with urllib.request.urlopen(f"{base_url}/ready", timeout=2) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read())
        except ValueError:
            return exc.code, {}
    except (OSError, ValueError):
        return 0, {}


class Announcer:
    """Says what a user can do, when it becomes true: the API answers, then a model is
    ready (its id in the line that says "serving")."""

    def __init__(self, config: ServeConfig, broker_kind: str) -> None:
        self.config = config
        self.broker_kind = broker_kind
        self.base_url = local_url(config.host, config.port)
        self.api_up = False
        self.done = False
        self._next = 0.0

    def check(self) -> None:
        if self.done or time.monotonic() < self._next:
            return
        self._next = time.monotonic() + READY_POLL_SECONDS
        status, body = readiness(self.base_url)
        if status and not self.api_up:
            self.api_up = True
            log.info("the API answers on %s; waiting for a worker to load a model", self.base_url)
        if status == 200:
            self.done = True
            models = ", ".join(body.get("models", [])) or "?"
            print(
                f"llmq is serving on http://{self.config.host}:{self.config.port} "
                f"(ready: {models}; broker: {self.broker_kind})",
                flush=True,
            )
            hint = activate_hint()
            if hint:
                print(hint, flush=True)


def activate_hint() -> str | None:
    """The one line that puts `llmq` on PATH in another shell, when this runs from a virtual
    environment whose bin/ is not on PATH (`make serve` runs .venv/bin/llmq directly)."""
    if sys.prefix == sys.base_prefix:
        return None
    bin_dir = Path(sys.prefix) / "bin"
    on_path = os.environ.get("PATH", "").split(os.pathsep)
    if any(Path(p).resolve() == bin_dir.resolve() for p in on_path if p):
        return None
    activate = bin_dir / "activate"
    try:
        shown = activate.relative_to(Path.cwd())
    except ValueError:
        shown = activate
    return f"llmq commands in another shell (llmq generate, llmq batch ...): source {shown}"


def check_device_usable(device: str | None) -> None:
    """Raise ServeError (one line) if the workers' device cannot run here: refused before
    anything starts, rather than by each worker in turn until serve gives up."""
    from runtime.devices import DeviceError, check_device
    from workers.config import DEVICE_ENV

    device = device or os.environ.get(DEVICE_ENV)
    if not device:
        return
    try:
        check_device(device)
    except DeviceError as exc:
        raise ServeError(str(exc)) from None


def serve(config: ServeConfig) -> int:
    home = config.home()
    home_lock = hold_lock(home, "serve.lock")  # ours: no live serve owns what it names
    try:
        return _serve(config, home.resolve())  # one name for it, whatever the cwd
    finally:
        home_lock.close()


def _serve(config: ServeConfig, home: Path) -> int:
    # what a serve of this folder that died left running: an API on the port, workers
    leftovers.stop(leftovers.marked(str(home)), STOP_GRACE_SECONDS, "processes")
    check_port_free(config.host, config.port)  # before anything starts: nothing to undo
    check_device_usable(config.device)
    from workers.wire.broker import URL_ENV, BrokerConfigError, BrokerSettings

    try:  # REDIS_URL (or --redis-url) and REDIS_SENTINELS both set: refused before anything
        settings = BrokerSettings.from_env(url=config.redis_url)
    except BrokerConfigError as exc:
        raise ServeError(str(exc)) from None
    if settings.uses_sentinel:
        broker = Broker(None, sentinel=settings.describe())
    else:
        broker = Broker(config.redis_url or os.environ.get(URL_ENV), data_dir=config.broker_dir())
    url = broker.start()
    env = {**os.environ, "HOST": config.host, "PORT": str(config.port), SERVED_BY_ENV: str(home)}
    if url is not None:
        env[URL_ENV] = url
    children = [
        Child("api", llmq_command("api", "--host", config.host, "--port", str(config.port)), env)
    ]
    worker_args = ["worker"]
    if config.models:
        worker_args += ["--models", ",".join(config.models)]
    if config.max_sequences:
        worker_args += ["--max-batch", str(config.max_sequences)]
    if config.device:
        worker_args += ["--device", config.device]
    if config.worker_nice:  # its threads, where the kernel has no autogroups
        worker_args += ["--nice", str(config.worker_nice)]
    for i in range(config.workers):
        children.append(
            Child(
                f"worker-{i}",
                llmq_command(*worker_args),
                env,
                again=WORKER_AGAIN_SECONDS,
                nice=config.worker_nice,
            )
        )
    # webhook deliveries (workers/webhooks/): apart from the workers, so a slow receiver
    # never holds a decode step
    children.append(Child("webhooks", llmq_command("webhooks"), env))

    stopping = threading.Event()

    def request_stop(signum: int, _frame: object) -> None:
        log.info("received %s: stopping every process", signal.Signals(signum).name)
        stopping.set()

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # nohup: the user said no
        signal.signal(signal.SIGHUP, request_stop)  # a closed terminal stops everything
    announcer = Announcer(config, broker.kind)
    try:
        for child in children:
            child.start()
        while not stopping.wait(0.2):
            for child in children:
                child.poll()
                child.maybe_restart()
            announcer.check()
    finally:
        _stop_children(children)
        broker.stop()
    return 0


def _stop_children(children: list[Child]) -> None:
    for child in children:
        child.signal(signal.SIGTERM)
    # each keeper SIGKILLs its child's group after STOP_GRACE_SECONDS; a keeper that has
    # not ended by then is killed here, and its child with it (PR_SET_PDEATHSIG)
    deadline = time.monotonic() + STOP_GRACE_SECONDS + KEEPER_SLACK_SECONDS
    for child in children:
        if child.process is None:
            continue
        try:
            child.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %ds; killing it", child.name, STOP_GRACE_SECONDS)
            child.signal(signal.SIGKILL)
            child.process.wait()


SERVE_HELP = """run everything: broker, API and workers (what `make serve` runs)

Run the whole system: the API on http://HOST:PORT and N workers, against REDIS_URL if set
(or the master REDIS_SENTINELS name), else a redis-server started on a free port (the one on
PATH, else the one installed with llmq) that keeps its jobs in $LLMQ_CACHE_DIR/broker, so
they survive a restart. Ctrl-C stops every process it started.
"""


def add_serve_commands(sub: argparse._SubParsersAction) -> None:
    serve_parser = add_command(sub, "serve", SERVE_HELP)
    add_listen_options(serve_parser)
    serve_parser.add_argument("--workers", type=int, default=1, help="worker processes")
    serve_parser.add_argument(
        "--models",
        default="",
        metavar="M,...",
        help="models the workers serve, loaded as they start (default: every registry "
        "model; the default one is loaded at start, the others on first use)",
    )
    serve_parser.add_argument(
        "--max-batch",
        type=int,
        help="sequences each worker steps together (default: 32 on the cpu, 256 on a cuda device)",
    )
    serve_parser.add_argument(
        "--device",
        metavar="cpu|cuda[:N]",
        help="where the workers run every model; refused in one line before anything starts "
        "if this machine cannot (default: $LLMQ_DEVICE, else each model's registry `device`, "
        "else cpu)",
    )
    serve_parser.add_argument(
        "--no-persist",
        dest="durable",
        action="store_false",
        help="the embedded broker saves nothing: jobs still queued or running are lost when "
        "serve stops (default: kept in $LLMQ_BROKER_DIR, else $LLMQ_CACHE_DIR/broker/serve-PORT)",
    )
    serve_parser.add_argument(
        "--worker-nice",
        type=int,
        default=None,
        metavar="N",
        help="the workers' CPU priority below the API and the broker, as a nice value 0-19: "
        "on busy cores the API answers first and the workers take what is left "
        f"(default: $LLMQ_WORKER_NICE, else {WORKER_NICE}: the same priority; a nice worker "
        "yields to every other process too: workers/priority.py)",
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
        max_sequences=args.max_batch,  # the published flag's name for the step's sequences
        device=args.device,
        durable=args.durable,
        worker_nice=worker_nice(args.worker_nice),
    )
    return serve(config)
