"""`llmq serve` as a user runs it: a real API, worker and broker as child processes, watched
by tests/workers/serve_run.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import redis

from tests.workers.conftest import REPO, wait_for
from tests.workers.serve_run import Serve
from workers import leftovers
from workers.child_death import keeper_argv
from workers.redis_server import RedisServerProcess, find_redis_server
from workers.supervisor import Broker, free_port

pytestmark = pytest.mark.integration


@pytest.fixture
def serve() -> Iterator[type[Serve]]:
    runs: list[Serve] = []

    def start(*args: str, **kw) -> Serve:
        runs.append(Serve(*args, **kw))
        return runs[-1]

    yield start  # type: ignore[misc]
    for run in runs:
        run.stop()


def test_a_port_in_use_is_refused_before_anything_starts(serve) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        started = time.monotonic()
        run = serve("--port", str(port))
        assert run.wait(20) != 0
        assert time.monotonic() - started < 10
    assert "address already in use" in run.output()
    assert "serving" not in run.output()
    assert run.leftovers() == []


def test_a_cuda_device_without_cuda_is_refused_in_one_line_before_anything_starts(
    serve,
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for machines without it")
    run = serve("--port", str(free_port()), "--device", "cuda")
    assert run.wait(60) == 1, run.output()
    assert run.stderr == [
        f"llmq: error: device cuda:0: this torch ({torch.__version__}) sees no CUDA device; "
        "install a CUDA build of torch on a machine with an NVIDIA GPU, or use --device cpu"
    ]
    assert "serving" not in run.output() and run.leftovers() == []


def test_a_child_that_fails_at_once_again_and_again_stops_everything(serve) -> None:
    """A worker that cannot start (here: an unknown model) is not restarted for ever while
    the API and the broker run on: serve gives up with the worker's own error."""
    run = serve("--port", str(free_port()), "--models", "no-such-model")
    assert run.wait(90) == 1, run.output()
    err = "\n".join(run.stderr)
    assert "worker-0 exited with 1" in err and "giving up" in err
    assert "unknown model 'no-such-model'" in err.split("giving up", 1)[1]  # its last lines
    assert "serving" not in run.output()
    assert len(run.tree) >= 2  # it did start processes (API, workers, maybe a broker) ...
    assert run.leftovers() == []  # ... and stopped every one


def test_serve_says_serving_once_the_default_model_is_loaded(serve, tmp_path: Path) -> None:
    """The first ten minutes: `llmq serve` prints "serving" only when /ready holds, with
    the model that is ready; /ready said not ready while the model loaded; the first request
    finds it loaded; the hint it prints puts `llmq` on PATH; Ctrl-C leaves nothing behind."""
    port = free_port()
    bin_dir = str(Path(sys.executable).parent)
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != bin_dir)
    run = serve("--port", str(port), env={**os.environ, "PATH": path, "VIRTUAL_ENV": ""})
    base = f"http://127.0.0.1:{port}"
    seen: list[tuple[int, str]] = []  # /ready's answers until "serving" was printed

    def serving() -> bool:
        assert run.process.poll() is None, run.output()
        if any("llmq is serving" in line for line in run.stdout):
            return True
        try:
            response = httpx.get(f"{base}/ready", timeout=2)
        except httpx.TransportError:
            return False
        code = (
            response.json().get("error", {}).get("code", "") if response.status_code != 200 else ""
        )
        seen.append((response.status_code, code))
        return False

    wait_for(serving, timeout=180, what="llmq serve to say it is serving")
    line = next(line for line in run.stdout if "llmq is serving" in line)
    assert f"http://127.0.0.1:{port}" in line and "ready: smollm2-135m-instruct" in line
    assert httpx.get(f"{base}/ready").json()["models"] == ["smollm2-135m-instruct"]
    assert (503, "model_loading") in seen, seen  # the worker was up, its model not yet
    assert seen.index((503, "model_loading")) < min(
        (i for i, (status, _) in enumerate(seen) if status == 200), default=len(seen)
    )

    hint = next(line for line in run.stdout if "source " in line)
    activate = hint.split("source ", 1)[1].strip()
    found = subprocess.run(
        ["bash", "-c", f"source {activate} && command -v llmq"],
        cwd=REPO,
        env={**os.environ, "PATH": path},
        capture_output=True,
        text=True,
    )
    assert found.returncode == 0 and found.stdout.strip().endswith("bin/llmq"), found

    asked = time.time()
    body = {"model": "smollm2-135m-instruct", "prompt": "The capital of France is"}
    reply = httpx.post(
        f"{base}/v1/completions", json={**body, "max_tokens": 4, "temperature": 0}, timeout=60
    )
    assert reply.status_code == 200, reply.text
    assert "Paris" in reply.json()["choices"][0]["text"]
    pools = {m["id"]: m["pools"] for m in httpx.get(f"{base}/admin/models").json()["data"]}
    (entry,) = pools["smollm2-135m-instruct"].values()
    assert entry["state"] == "ready" and entry["loaded_at"] < asked  # loaded before it asked
    assert "\n".join(run.stderr).count("loading model smollm2-135m-instruct") == 1

    run.process.send_signal(signal.SIGINT)
    assert run.wait(60) == 0, run.output()
    assert run.leftovers() == []


def test_a_keeper_stops_its_child_and_the_child_s_group_when_its_parent_is_killed() -> None:
    """workers/child_death.py: serve (here a stand-in process) killed -9; the child ignores
    SIGTERM and has started a grandchild in its group: both are gone by the orphan grace."""
    parent_code = (
        "import subprocess, sys, time\n"
        "from workers.child_death import keeper_argv\n"
        "script = 'trap \"\" TERM; sleep 300 & wait'\n"
        "keeper = subprocess.Popen(keeper_argv(['sh', '-c', script], grace=30, orphan_grace=2),"
        " start_new_session=True)\n"
        "print(keeper.pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        keeper = psutil.Process(int(parent.stdout.readline()))
        wait_for(lambda: len(keeper.children(recursive=True)) == 2, 20, "the child and its child")
        kept = [keeper, *keeper.children(recursive=True)]
        killed = time.monotonic()
        parent.kill()
        parent.wait(10)
        _, alive = psutil.wait_procs(kept, timeout=2 + 20)  # orphan grace + slack
        assert alive == []
        assert time.monotonic() - killed >= 1.5  # the SIGTERM was ignored: SIGKILL at 2 s
    finally:
        parent.kill()
        parent.wait(10)
        parent.stdout.close()


def test_a_keeper_exits_as_its_child_did() -> None:
    exited = subprocess.run(keeper_argv(["sh", "-c", "exit 3"], grace=5, orphan_grace=5))
    assert exited.returncode == 3
    killed = subprocess.run(keeper_argv(["sh", "-c", "kill -9 $$"], grace=5, orphan_grace=5))
    assert killed.returncode == -signal.SIGKILL


def test_only_processes_marked_with_the_serve_s_folder_are_stopped(tmp_path: Path) -> None:
    def sleeper(marker: str | None) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k != leftovers.SERVED_BY_ENV}
        if marker is not None:
            env[leftovers.SERVED_BY_ENV] = marker
        return subprocess.Popen(["sleep", "300"], env=env)

    ours = sleeper(str(tmp_path))
    others = [sleeper(str(tmp_path / "other")), sleeper(None)]
    try:
        wait_for(lambda: leftovers.marked(str(tmp_path)) == [ours.pid], 10, "the marked one")
        leftovers.stop(leftovers.marked(str(tmp_path)), 10, "test processes")
        assert ours.wait(10) == -signal.SIGTERM
        assert all(other.poll() is None for other in others)
    finally:
        for proc in [ours, *others]:
            proc.kill()
            proc.wait(10)


def test_a_broker_left_running_on_the_data_folder_is_shut_down_and_its_data_kept(
    tmp_path: Path,
) -> None:
    """A redis-server of a dead serve still on the folder (no keeper: an llmq serve from
    before them): the next serve's broker stops it (SIGTERM, Redis's SHUTDOWN) before it
    starts its own on the same append-only file, which holds what the old one acknowledged.
    A redis-server on another folder is left alone."""
    binary = find_redis_server()
    data_dir = tmp_path / "broker" / f"redis{binary.version[0]}"
    stale = RedisServerProcess(binary, free_port(), data_dir)
    elsewhere = RedisServerProcess(binary, free_port(), tmp_path / "elsewhere")
    broker = Broker(None, data_dir=tmp_path / "broker")
    try:
        with redis.Redis.from_url(stale.start()) as conn:
            conn.set("acknowledged", "yes")
        elsewhere.start()
        assert leftovers.redis_servers_in(data_dir) == [stale.process.pid]
        with redis.Redis.from_url(broker.start()) as conn:
            assert conn.get("acknowledged") == b"yes"
        assert stale.process.wait(10) == 0  # a clean shutdown, not a kill
        assert elsewhere.process.poll() is None
    finally:
        broker.stop()
        stale.stop()
        elsewhere.stop()
