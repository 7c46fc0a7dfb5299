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
import pytest

from tests.workers.conftest import REPO, wait_for
from tests.workers.serve_run import Serve, free_port

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
