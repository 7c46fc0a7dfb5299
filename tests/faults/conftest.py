"""The fault-injection harness of docs/faults.md (its F section), on one machine, loopback only.

Each test gets its own `redis-server` on a free port (never the shared 6379: these tests
shut theirs down and restart it), the API under gunicorn as `llmq api` runs it (access log
kept, to count 5xx answers), and real `llmq worker` processes serving a tiny random llama,
slowed down per step so that generations are still running when a fault hits.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import psutil
import pytest
import redis

from api.cli import CONF
from tests.api.sse import Message, parse
from tests.redis_db import redis_binary
from tests.tiny_models import write_tiny_llama
from tests.workers.conftest import REPO, WorkerProcess, signal_then_kill, wait_for
from tests.workers.serve_run import Serve
from workers.redis_server import RedisServerProcess, pings
from workers.supervisor import STOP_GRACE_SECONDS, free_port
from workers.wire.job import TERMINAL_STATUSES

MODEL = "tiny-faults"  # the model id: the tiny GGUF's file stem
LOG_TAIL_CHARS = 6000  # of each process's log, printed when a fault test fails
CALL_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    """Keeps whether the test body failed, for the fixtures below to print their processes'
    logs then: a fault seen once on a busy CI machine is read from CI's output."""
    report = yield
    if report.when == "call":
        item.stash[CALL_FAILED] = report.failed
    return report


def print_log_if_failed(request: pytest.FixtureRequest, name: str, output: str) -> None:
    if request.node.stash.get(CALL_FAILED, False):
        print(f"----- {name}: the last {LOG_TAIL_CHARS} characters of its log -----")
        print(output[-LOG_TAIL_CHARS:])


class RedisServer(RedisServerProcess):
    """A redis-server of this test's own, started as `llmq serve` starts its broker
    (workers/redis_server.py: the same arguments and a session of its own; persistent, an
    append-only file fsynced as `LLMQ_BROKER_APPENDFSYNC` says, by default before every
    reply), which the test can shut down and start again on the same port: with its file
    (F7) or with no persistence at all (F8)."""

    def __init__(self, directory: Path, persistent: bool) -> None:
        port = free_port()
        data_dir = directory / f"redis-{port}" if persistent else None
        super().__init__(redis_binary(), port, data_dir)

    def pings(self) -> bool:
        return pings(self.url)

    def shutdown(self) -> None:
        """`redis-cli shutdown`, as docs/faults.md F7 does (a durable server writes it first)."""
        assert self.process is not None
        with redis.Redis.from_url(self.url) as client:
            try:
                client.shutdown()
            except redis.ConnectionError:
                pass
        self.process.wait(10)


@pytest.fixture
def fault_redis(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    servers: list[RedisServer] = []

    def start(persistent: bool = True) -> RedisServer:
        server = RedisServer(tmp_path, persistent)
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def fault_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("fault-models") / f"{MODEL}.gguf")


class Api:
    """`llmq api`'s gunicorn (its config and worker class) with `processes` processes."""

    def __init__(self, redis_url: str, processes: int, **extra_env: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log")
        env = {**os.environ, "REDIS_URL": redis_url, "PYTHONUNBUFFERED": "1", **extra_env}
        env.pop("LLMQ_API_KEYS", None)
        argv = [sys.executable, "-m", "gunicorn", "-c", str(CONF), "-b", f"127.0.0.1:{self.port}"]
        argv += ["-w", str(processes), "api.app:create_app()"]
        self.process = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT
        )
        wait_for(self._healthy, 30, "gunicorn to answer /health")

    def _healthy(self) -> bool:
        assert self.process.poll() is None, self.output()
        try:
            return httpx.get(f"{self.base}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def server_errors(self) -> list[str]:
        """Access-log lines of answers with a 5xx status (docs/faults.md: none allowed
        except the 503s of a broker that is down)."""
        lines = re.findall(r'^.*"[A-Z]+ [^"]*" (5\d\d) .*$', self.output(), re.M)
        return [s for s in lines if s != "503"]

    def stop(self) -> None:
        signal_then_kill(self.process, signal.SIGTERM, 15)
        self.log.close()


def stop_all(
    request: pytest.FixtureRequest, started: Sequence[Api | WorkerProcess], name: Callable
) -> None:
    """A fixture's teardown: stop each process it started, after printing the tail of its
    log (`name(process)` names it) if the test failed."""
    for process in started:
        print_log_if_failed(request, name(process), process.output())
        process.stop()


@pytest.fixture
def start_api(request: pytest.FixtureRequest) -> Iterator[Callable[..., Api]]:
    apis: list[Api] = []

    def start(redis_url: str, processes: int = 1, **extra_env: str) -> Api:
        api = Api(redis_url, processes, **extra_env)
        apis.append(api)
        return api

    yield start
    stop_all(request, apis, lambda api: f"API on port {api.port}")


@pytest.fixture
def start_workers(
    request: pytest.FixtureRequest, fault_model: Path
) -> Iterator[Callable[..., list[WorkerProcess]]]:
    started: list[WorkerProcess] = []

    def start(
        redis_url: str, count: int = 1, step_delay_ms: int = 20, extra: tuple[str, ...] = ()
    ) -> list[WorkerProcess]:
        procs = [
            WorkerProcess(
                f"fault-w{len(started) + i}",
                [str(fault_model)],
                *extra,
                step_delay_ms=step_delay_ms,
                redis_url=redis_url,
            )
            for i in range(count)
        ]
        started.extend(procs)
        return procs

    yield start
    stop_all(request, started, lambda proc: f"worker {proc.name}")


class FaultSystem(NamedTuple):
    """A test's own broker, API and workers, started and serving (`start_system`)."""

    server: RedisServer
    api: Api
    workers: list[WorkerProcess]


@pytest.fixture
def start_system(fault_redis, start_api, start_workers) -> Callable[..., FaultSystem]:
    """Most F tests' setup in one call: a redis-server, the API with `processes` gunicorn
    processes (and `api_env`), `workers` workers, then wait until one serves the model."""

    def start(
        *,
        persistent: bool = False,
        processes: int = 1,
        workers: int = 1,
        step_delay_ms: int = 20,
        worker_args: tuple[str, ...] = (),
        **api_env: str,
    ) -> FaultSystem:
        server = fault_redis(persistent=persistent)
        api = start_api(server.url, processes, **api_env)
        procs = start_workers(server.url, workers, step_delay_ms, worker_args)
        wait_ready(api)
        return FaultSystem(server, api, procs)

    return start


def kill_api(api: Api) -> None:
    """kill -9 the whole API: gunicorn's master and every process under it."""
    master = psutil.Process(api.process.pid)
    children = master.children(recursive=True)
    master.kill()
    for child in children:
        child.kill()
    api.process.wait(10)


def wait_ready(api: Api, timeout: float = 60) -> None:
    wait_for(
        lambda: httpx.get(f"{api.base}/ready", timeout=3).status_code == 200,
        timeout,
        "a worker with the model loaded",
    )


def submit_async(base: str, max_tokens: int, prompt: str = "hello", **extra: Any) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body["ignore_eos"] = True  # exactly max_tokens tokens: a gap cannot hide as an early end
    body.update(extra)
    response = httpx.post(
        f"{base}/v1/completions", json=body, headers={"Prefer": "respond-async"}, timeout=10
    )
    assert response.status_code == 202, response.text
    return response.json()["id"]


def job(base: str, job_id: str) -> httpx.Response:
    return httpx.get(f"{base}/v1/jobs/{job_id}", timeout=10)


def wait_terminal(base: str, job_id: str, timeout: float) -> dict[str, Any]:
    def ended() -> dict[str, Any] | None:
        try:
            response = job(base, job_id)
        except httpx.TransportError:
            return None
        if response.status_code != 200:
            return None
        body = response.json()
        return body if body["status"] in TERMINAL_STATUSES else None

    return wait_for(ended, timeout, f"job {job_id} to end")


@dataclass
class EventLog:
    """What one SSE follower saw over all its connections: every message with the
    connection (attempt) it came on, and how each connection ended."""

    messages: list[tuple[int, Message]] = field(default_factory=list)
    arrived: list[float] = field(default_factory=list)  # monotonic time of each message
    attempts: int = 0
    errors: list[dict[str, Any]] = field(default_factory=list)
    transport_errors: int = 0
    ended: str | None = None  # "done" or "error" once a terminal event arrived

    @property
    def last_id(self) -> str | None:
        ids = [m.id for _, m in self.messages if m.id]
        return ids[-1] if ids else None

    def tokens(self) -> list[dict[str, Any]]:
        return [m.json() for _, m in self.messages if m.event == "token"]

    def ids(self) -> list[str]:
        return [m.id for _, m in self.messages if m.id]


def follow_once(
    base: str, job_id: str, log: EventLog, timeout: float = 10, on_message=None
) -> None:
    """One connection to the job's events, resuming after the last id seen."""
    log.attempts += 1
    headers = {"Last-Event-ID": log.last_id} if log.last_id else {}
    try:
        with httpx.stream(
            "GET", f"{base}/v1/jobs/{job_id}/events", headers=headers, timeout=timeout
        ) as response:
            if response.status_code != 200:
                log.errors.append({"status": response.status_code, "body": response.read()})
                return
            for message in parse(response.iter_lines()):
                if message.event is None and message.id is None:
                    continue  # retry: and : ping
                log.messages.append((log.attempts, message))
                log.arrived.append(time.monotonic())
                if on_message is not None:
                    on_message(message)
                if message.event == "error":
                    log.errors.append(message.json())
                    if message.id is not None:  # the job's own terminal error
                        log.ended = "error"
                    return
                if message.event == "done":
                    log.ended = "done"
                    return
    except httpx.TransportError:
        log.transport_errors += 1


def follow_to_end(base: str, job_id: str, deadline: float, log: EventLog | None = None):
    """Follow, reconnecting with Last-Event-ID (after the server's `retry:` 2 s, shortened
    here to 0.2 s) until a terminal event or the deadline."""
    log = log or EventLog()
    while log.ended is None and time.monotonic() < deadline:
        follow_once(base, job_id, log)
        if log.ended is None:
            time.sleep(0.2)
    return log


class Follower:
    """`follow_to_end` on a daemon thread of its own, started at once: the test acts on the
    system while `log` fills; `join` waits for the follower to end."""

    def __init__(self, base: str, job_id: str, deadline: float) -> None:
        self.log = EventLog()
        self.thread = threading.Thread(
            target=follow_to_end, args=(base, job_id, deadline, self.log), daemon=True
        )
        self.thread.start()

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)


def assert_no_gap_no_repeat(log: EventLog, max_tokens: int) -> None:
    """Token indices 0..max_tokens-1 each exactly once and in order; event ids strictly
    increasing across every reconnection."""
    indices = [t["index"] for t in log.tokens()]
    assert indices == list(range(len(indices))), f"gap or repeat: {indices}"
    assert len(indices) == max_tokens
    ids = [tuple(int(p) for p in i.split("-")) for i in log.ids()]
    assert ids == sorted(set(ids)), "an event id came twice or out of order"


def jdump(value: Any) -> str:
    return json.dumps(value)[:500]


class StallingProxy:
    """A TCP proxy between one client (a worker) and Redis that can stall: while stalled it
    forwards nothing either way and holds new connections, like a partition that drops
    packets rather than refusing them (docs/faults.md F12)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.flowing = threading.Event()
        self.flowing.set()
        self.closed = False
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def stall(self) -> None:
        self.flowing.clear()

    def resume(self) -> None:
        self.flowing.set()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.flowing.wait()
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                self.flowing.wait()  # a stall holds the bytes here
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.closed = True
        self.flowing.set()
        self.listener.close()
        for sock in self.sockets:
            sock.close()


class Served:
    """`llmq serve --workers N` as `make serve` runs it (its own process group), on a free
    port with `--models` the tiny model; its whole output kept in a temporary file."""

    def __init__(self, env: dict[str, str], model: Path, workers: int = 2) -> None:
        self.base = f"http://127.0.0.1:{free_port()}"
        port = self.base.rsplit(":", 1)[1]
        self.log = tempfile.TemporaryFile("w+")
        argv = [sys.executable, "-m", "llmq", "serve", "--workers", str(workers), "--port", port]
        self.proc = subprocess.Popen(
            [*argv, "--models", str(model)],
            cwd=REPO,
            env={**env, "PYTHONUNBUFFERED": "1"},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 90) -> None:
        wait_for(lambda: self.ready() or self.proc.poll() is not None, timeout, "llmq serve")
        assert self.proc.poll() is None, self.output()[-3000:]

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.base}/ready", timeout=3).status_code == 200
        except httpx.TransportError:
            return False

    def worker_pids(self) -> list[tuple[str, int]]:
        """(name, pid) of each live worker, as /admin/workers lists them."""
        data = httpx.get(f"{self.base}/admin/workers", timeout=10).json()["data"]
        return sorted((w["name"], w["pid"]) for w in data if w["alive"])

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        """Ctrl-C, as a user stops it; SIGKILL to the group if it has not ended well after
        serve's own grace (its children run in sessions of their own: serve alone can kill
        one that ignores SIGTERM, so it must outlive that grace)."""
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(STOP_GRACE_SECONDS + 15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.log.close()


@pytest.fixture
def serve_runs() -> Iterator[list[Serve]]:
    """`llmq serve` runs a test starts (append each), stopped after it, however it ends."""
    runs: list[Serve] = []
    yield runs
    for run in runs:
        run.stop()
