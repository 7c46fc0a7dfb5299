"""Fixtures for worker tests: real Redis (db 14, flushed before and after each test), tiny
GGUF models, jobs submitted as the API submits them, and workers run in a thread or as real
`llmq worker` processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis
from rq import Queue
from rq.serializers import JSONSerializer

from tests.tiny_models import write_tiny_llama
from workers import keys
from workers.config import WorkerConfig
from workers.wire.events import decode_event
from workers.wire.job import JOB_FUNCTION, TERMINAL_STATUSES, JobRecord
from workers.wire.rq_job import write_queued_rq_job
from workers.worker import LLMQWorker, connect

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/14"
REPO = Path(__file__).resolve().parents[2]
TINY = "tiny-llama"  # the model id of the tiny model file (its stem)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("models") / f"{TINY}.gguf")


@pytest.fixture(scope="session")
def redis_url() -> str:
    """$LLMQ_WORKERS_TEST_REDIS_URL, else db 14 of the Redis on 6379 (tests/conftest.py starts
    one for the session, and sets the variable, on a machine without a Redis service)."""
    return os.environ.get("LLMQ_WORKERS_TEST_REDIS_URL", DEFAULT_REDIS_URL)


def _pings(url: str) -> bool:
    try:
        with redis.Redis.from_url(url, socket_connect_timeout=1) as client:
            return bool(client.ping())
    except redis.ConnectionError:
        return False


@pytest.fixture
def conn(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    if not _pings(redis_url):
        pytest.fail(f"these tests need Redis at {redis_url}")
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


def submit(
    conn: redis.Redis,
    endpoint: str,
    body: dict[str, Any],
    model: str = TINY,
    kind: str = keys.INTERACTIVE,
    func: str = JOB_FUNCTION,
    args: list[Any] | None = None,
    priority: int = 0,
) -> str:
    """Store a job record and enqueue its id as the API does: with RQ's `enqueue_call`, or for
    a priority other than 0 on its level list (`keys.level_queue_name`), as `api.gate` does."""
    job_id = uuid.uuid4().hex
    record = JobRecord(
        id=job_id, endpoint=endpoint, model=model, request=body, kind=kind, priority=priority
    )
    conn.hset(keys.job(job_id), mapping=record.to_hash())
    queue = Queue(keys.queue_name(model, kind), connection=conn, serializer=JSONSerializer)
    if priority == 0:
        queue.enqueue_call(
            func=func,
            args=args if args is not None else [job_id],
            job_id=job_id,
            description=job_id,
        )
        return job_id
    level_key = Queue.redis_queue_namespace_prefix + keys.level_queue_name(queue.name, priority)
    with conn.pipeline() as pipe:
        write_queued_rq_job(pipe, conn, job_id, queue.name)
        pipe.rpush(level_key, job_id)
        pipe.sadd(Queue.redis_queues_keys, level_key)
        pipe.zadd(keys.queue_levels(queue.name), {str(priority): priority})
        pipe.execute()
    return job_id


def record(conn: redis.Redis, job_id: str) -> JobRecord:
    return JobRecord.from_hash(conn.hgetall(keys.job(job_id)))


def stream(conn: redis.Redis, job_id: str) -> list[tuple[str, dict[str, Any]]]:
    return [decode_event(fields) for _, fields in conn.xrange(keys.job_events(job_id))]


def tokens(conn: redis.Redis, job_id: str) -> list[dict[str, Any]]:
    return [data for kind, data in stream(conn, job_id) if kind == "token"]


# Deadlines for what must happen, not for how fast: they cost nothing when things are quick,
# and a machine shared with busy processes (CI) may take several times as long.
WAIT_SECONDS = 30.0


def wait_for(predicate: Callable[[], Any], timeout: float = WAIT_SECONDS, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")


def wait_done(conn: redis.Redis, job_id: str, timeout: float = WAIT_SECONDS) -> JobRecord:
    def ended() -> JobRecord | None:
        current = record(conn, job_id)
        return current if current.status in TERMINAL_STATUSES else None

    return wait_for(ended, timeout, f"job {job_id} to end")


class WorkerThread:
    """An `LLMQWorker` running in a thread of the test process (no signal handlers)."""

    def __init__(self, redis_url: str, models: list[str], **overrides: Any) -> None:
        settings = {"poll_interval": 0.02, "name": f"w-{uuid.uuid4().hex[:6]}"} | overrides
        config = WorkerConfig(redis_url=redis_url, models=models, install_signals=False, **settings)
        self.worker = LLMQWorker(config, connect(redis_url))
        self.thread = threading.Thread(target=self.worker.work, daemon=True)

    def __enter__(self) -> LLMQWorker:
        self.thread.start()
        return self.worker

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, drain: bool = False) -> None:
        self.worker.request_stop(signal.SIGTERM, None)
        if not drain:
            self.worker.request_stop(signal.SIGTERM, None)
        self.thread.join(15)
        assert not self.thread.is_alive(), "the worker thread did not stop"
        self.worker.connection.close()


@pytest.fixture
def start_worker(tiny_model: Path, redis_url: str) -> Iterator[Callable[..., LLMQWorker]]:
    started: list[WorkerThread] = []

    def start(models: list[str] | None = None, **overrides: Any) -> LLMQWorker:
        runner = WorkerThread(redis_url, models or [str(tiny_model)], **overrides)
        started.append(runner)
        return runner.__enter__()

    yield start
    for runner in started:
        if runner.thread.is_alive():
            runner.stop()


def llmq_process(*args: str, env: dict[str, str], stdout: Any, stderr: Any) -> subprocess.Popen:
    """`python -m llmq ARGS` from the repository, as text, in a session of its own: a test
    can then signal or kill the whole tree it starts (`os.killpg`)."""
    argv = [sys.executable, "-m", "llmq", *args]
    return subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=stdout, stderr=stderr, text=True, start_new_session=True
    )


def signal_then_kill(
    process: subprocess.Popen, sig: int, grace: float, *, group: bool = False
) -> None:
    """Stop a child a test started, if it still runs: `sig` first, and SIGKILL (to its whole
    process group with `group`) if it has not exited `grace` seconds later."""
    if process.poll() is not None:
        return
    process.send_signal(sig)
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        if group:
            os.killpg(process.pid, signal.SIGKILL)
        else:
            process.kill()
        process.wait(10)


class WorkerProcess:
    """A real `llmq worker` process in its own session, so a test can kill its whole tree."""

    def __init__(
        self,
        name: str,
        models: list[str],
        *extra: str,
        step_delay_ms: int = 0,
        redis_url: str = DEFAULT_REDIS_URL,
    ) -> None:
        env = {**os.environ, "REDIS_URL": redis_url, "PYTHONUNBUFFERED": "1"}
        if step_delay_ms:
            env["LLMQ_WORKER_STEP_DELAY_MS"] = str(step_delay_ms)
        self.name = name
        self.log = tempfile.TemporaryFile("w+")  # a pipe nobody reads could block the worker
        self.process = llmq_process(
            *("worker", "--name", name, "--models", ",".join(models), *extra),
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def wait_registered(self, conn: redis.Redis, timeout: float = 60.0) -> None:
        wait_for(
            lambda: conn.exists(keys.worker(self.name)) or self.process.poll() is not None,
            timeout,
            f"worker {self.name} to register",
        )
        assert self.process.poll() is None, self.output()

    def assert_alive(self) -> None:
        assert self.process.poll() is None, f"worker {self.name} exited:\n{self.output()}"

    def kill_tree(self) -> list[psutil.Process]:
        """kill -9 the worker and every process it started (docs/faults.md L2: the whole tree);
        returns them, so a test can check that none survived (`psutil.wait_procs`)."""
        root = psutil.Process(self.process.pid)
        tree = [root, *root.children(recursive=True)]
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)
        return tree

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
        self.log.close()


@contextmanager
def serving_workers(
    conn: redis.Redis, model: Path, redis_url: str
) -> Iterator[Callable[..., WorkerProcess]]:
    """Starts real workers serving `model` (a .gguf whose stem is its model id): each call
    returns once its worker is registered and the model is published, as the API needs
    before it accepts a request for it; every worker started is stopped at the end."""
    started: list[WorkerProcess] = []

    def start(name: str, *extra: str, step_delay_ms: int = 0) -> WorkerProcess:
        proc = WorkerProcess(
            name, [str(model)], *extra, step_delay_ms=step_delay_ms, redis_url=redis_url
        )
        started.append(proc)
        proc.wait_registered(conn)
        wait_for(lambda: conn.hexists(keys.MODELS, model.stem), 60, f"{model.stem} published")
        return proc

    try:
        yield start
    finally:
        for proc in started:
            proc.stop()


@pytest.fixture
def spawn_worker(tiny_model: Path, redis_url: str) -> Iterator[Callable[..., WorkerProcess]]:
    spawned: list[WorkerProcess] = []

    def spawn(name: str, *extra: str, models: list[str] | None = None, **kw: Any):
        kw.setdefault("redis_url", redis_url)
        proc = WorkerProcess(name, models or [str(tiny_model)], *extra, **kw)
        spawned.append(proc)
        return proc

    yield spawn
    for proc in spawned:
        proc.stop()
