"""Fixtures for API tests: a fakeredis app for unit tests; real Redis (db 13), a fake
worker thread and a real HTTP server for integration tests; and a whole llmq on the real
SmolLM2 (`smollm2_*`, db 10) for the structured-output and tool-calling tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fakeredis
import httpx
import openai
import pytest
import redis
from flask import Flask
from werkzeug.serving import WSGIRequestHandler, make_server

from api.app import create_app
from api.cli import CONF
from tests.api.fake_worker import FakeWorker
from tests.redis_db import clean_redis_db
from tests.tiny_models import write_tiny_llama
from tests.workers.conftest import WorkerProcess, wait_for
from workers import keys
from workers.supervisor import free_port
from workers.wire.worker_info import READY, WorkerInfo

TEST_REDIS_URL = os.environ.get("LLMQ_TEST_REDIS_URL", "redis://127.0.0.1:6379/13")
SMOLLM2_REDIS_URL = os.environ.get("LLMQ_SMOLLM2_TEST_REDIS_URL", "redis://127.0.0.1:6379/10")
SMOLLM2 = "smollm2-135m-instruct"


# ---------------------------------------------------------------- unit tier (fakeredis)


@pytest.fixture
def fake_redis() -> fakeredis.FakeRedis:
    return fakeredis.FakeRedis()


@pytest.fixture
def registered(fake_redis: fakeredis.FakeRedis) -> FakeWorker:
    """A worker that is registered and alive but never runs anything (jobs stay queued)."""
    return FakeWorker(fake_redis).register()


@pytest.fixture
def app(fake_redis: fakeredis.FakeRedis, registered: FakeWorker) -> Flask:
    return create_app({"TESTING": True, "REDIS_CLIENT": fake_redis})


@pytest.fixture
def client(app: Flask):
    return app.test_client()


@contextlib.contextmanager
def worker_thread(
    redis_url: str, conn: redis.Redis, model: Path, name: str, step_delay: float = 0.0
) -> Iterator[Any]:
    """A real `LLMQWorker` in a thread serving the tiny `model` (a .gguf whose stem is its
    model id), yielded once it has published the model ready; stopped as SIGTERM twice
    stops it (drain, then requeue at once)."""
    from workers.config import WorkerConfig
    from workers.worker import LLMQWorker, connect

    config = WorkerConfig(
        redis_url=redis_url,
        models=[str(model)],
        install_signals=False,
        poll_interval=0.02,
        step_delay=step_delay,
        name=name,
    )
    worker = LLMQWorker(config, connect(redis_url))
    thread = threading.Thread(target=worker.work, daemon=True)
    thread.start()
    wait_for(lambda: _published_ready(conn, worker.name, model.stem), 60, "the model ready")
    try:
        yield worker
    finally:
        worker.request_stop(signal.SIGTERM, None)
        worker.request_stop(signal.SIGTERM, None)
        thread.join(15)


def _published_ready(conn: redis.Redis, name: str, model: str) -> bool:
    raw = conn.hgetall(keys.worker(name))
    pool = WorkerInfo.from_hash(raw).pool if raw else {}
    return pool.get(model, {}).get("state") == READY and bool(conn.hexists(keys.MODELS, model))


# ---------------------------------------------------------------- integration tier


@pytest.fixture(scope="session")
def redis_url() -> str:
    """Real Redis: LLMQ_TEST_REDIS_URL (tests/conftest.py starts the session's own server and
    sets the variable where it is not set)."""
    return TEST_REDIS_URL


@pytest.fixture
def real_redis(redis_url: str) -> Iterator[redis.Redis]:
    with clean_redis_db(redis_url) as conn:
        yield conn


@pytest.fixture
def worker(real_redis: redis.Redis) -> Iterator[FakeWorker]:
    fake = FakeWorker(real_redis).start()
    yield fake
    fake.stop()


@pytest.fixture
def live_app(redis_url: str, real_redis: redis.Redis) -> Iterator[Flask]:
    app = create_app({"TESTING": True, "REDIS_URL": redis_url, "PING_SECONDS": 0.5})
    yield app
    app.extensions["redis"].close()


@pytest.fixture
def live_client(live_app: Flask):
    return live_app.test_client()


class QuietRequestHandler(WSGIRequestHandler):
    """Werkzeug's handler without its line per request: a test that polls for a minute
    would otherwise bury its own failure under hundreds of access-log lines."""

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        pass


@contextlib.contextmanager
def serving(app: Flask) -> Iterator[str]:
    """`app` on a real HTTP server (werkzeug, threaded) on a free loopback port: its URL."""
    httpd = make_server("127.0.0.1", 0, app, threaded=True, request_handler=QuietRequestHandler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_port}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


@pytest.fixture
def server(live_app: Flask) -> Iterator[str]:
    with serving(live_app) as url:
        yield url


@pytest.fixture
def oai(server: str) -> Iterator[openai.OpenAI]:
    """The official client against `server` (a module may give its own `server`)."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=30)
    yield client
    client.close()


def hang_up_after(
    server: str,
    body: dict[str, Any],
    lines: int = 6,
    timeout: float = 30,
    headers: dict[str, str] | None = None,
) -> None:
    """POST the streamed completion `body` to `server` and close the connection after its
    first `lines` lines, as a client that hangs up mid-stream."""
    url = f"{server}/v1/completions"
    with httpx.stream("POST", url, json=body, timeout=timeout, headers=headers) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i == lines:
                break


@pytest.fixture(scope="module")
def tiny_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama file whose model id (its stem) is the requesting module's MODEL."""
    return write_tiny_llama(tmp_path_factory.mktemp("models") / f"{request.module.MODEL}.gguf")


@contextlib.contextmanager
def _gunicorn(redis_url: str, **env_overrides: str) -> Iterator[str]:
    """`llmq api`'s gunicorn (config and worker class), one process on a free port; key
    sk-test unless `env_overrides` name others (LLMQ_API_KEYS)."""
    port = free_port()
    timeouts = ("LLMQ_HEADER_TIMEOUT", "LLMQ_BODY_TIMEOUT")
    env = {k: v for k, v in os.environ.items() if k not in timeouts}
    env.update({"REDIS_URL": redis_url, "LLMQ_API_KEYS": "sk-test", **env_overrides})
    argv = [sys.executable, "-m", "gunicorn", "-c", str(CONF), "-b", f"127.0.0.1:{port}"]
    proc = subprocess.Popen(
        [*argv, "-w", "1", "api.app:create_app()"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60  # generous: a busy machine starts gunicorn slowly
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            proc.wait()
            pytest.fail("gunicorn did not start")
        time.sleep(0.1)
    try:
        yield base
    finally:  # a failing test must not leave the server running
        proc.terminate()
        proc.wait(timeout=15)


@pytest.fixture
def gunicorn(redis_url: str, real_redis) -> Iterator[str]:
    """The API under gunicorn, key sk-test, header and body timeouts 2 s."""
    with _gunicorn(redis_url, LLMQ_HEADER_TIMEOUT="2", LLMQ_BODY_TIMEOUT="2") as base:
        yield base


@pytest.fixture
def gunicorn_default_timeouts(redis_url: str, real_redis) -> Iterator[str]:
    """The API under gunicorn, key sk-test, with the timeouts users get (10 s)."""
    with _gunicorn(redis_url) as base:
        yield base


# ---------------------------------------------------------------- the real SmolLM2
# Module scoped (loading SmolLM2 takes seconds): the db is flushed when a module starts and
# ends, not between its tests, which each submit their own jobs and look only at those.


@pytest.fixture(scope="module")
def smollm2_redis() -> Iterator[redis.Redis]:
    with clean_redis_db(SMOLLM2_REDIS_URL) as client:
        yield client


@pytest.fixture(scope="module")
def smollm2_server(smollm2_redis: redis.Redis) -> Iterator[str]:
    app = create_app({"TESTING": True, "REDIS_URL": SMOLLM2_REDIS_URL, "PING_SECONDS": 0.5})
    httpd = make_server("127.0.0.1", 0, app, threaded=True, request_handler=QuietRequestHandler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{httpd.server_port}"
    worker = WorkerProcess("smollm2-w1", [SMOLLM2], redis_url=SMOLLM2_REDIS_URL)
    try:
        wait_for(
            lambda: httpx.get(f"{base}/ready").status_code == 200 or worker.process.poll(),
            120,
            "SmolLM2 loaded",
        )
        worker.assert_alive()
        yield base
    finally:
        worker.stop()
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)
        app.extensions["redis"].close()


@pytest.fixture(scope="module")
def smollm2_oai(smollm2_server: str) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=f"{smollm2_server}/v1", api_key="x", max_retries=0, timeout=120)
    yield client
    client.close()
