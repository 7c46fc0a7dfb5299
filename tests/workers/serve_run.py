"""`llmq serve` as a user runs it, watched: its output read line by line, and every process it
started recorded, so that a test can tell that none outlived it.

A test tells that none of them outlived it two ways: each run carries a marker in its
environment, which every process it starts inherits, and its process tree is recorded while
it runs (redis-server rewrites its environment to set its process title; the children run
in sessions of their own, so once serve is gone they are no longer its descendants).
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil

from tests.workers.conftest import llmq_process, signal_then_kill, wait_for
from workers.supervisor import BROKER_DIR_ENV, free_port

MARKER = "LLMQ_TEST_SERVE_RUN"


def alive(proc: psutil.Process) -> bool:
    """Running, and still the process seen before (psutil checks the pid's start time)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Serve:
    """`python -m llmq serve ARGS` with its output read as it comes, line by line."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.run = uuid.uuid4().hex
        env = {**(env or os.environ), MARKER: self.run, "PYTHONUNBUFFERED": "1"}
        env.pop("REDIS_URL", None)  # a broker of its own, as on a fresh machine
        # its data in a folder of the test's, not the user's ~/.cache/llmq/broker
        self._broker_dir = tempfile.TemporaryDirectory(prefix="llmq-serve-broker-")
        env.setdefault(BROKER_DIR_ENV, self._broker_dir.name)
        self.process = llmq_process(
            "serve", *args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(pipe, lines), daemon=True)
            for pipe, lines in (
                (self.process.stdout, self.stdout),
                (self.process.stderr, self.stderr),
            )
        ]
        for reader in self._readers:
            reader.start()
        self.tree: dict[int, psutil.Process] = {}
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        """Record every process below serve while it runs."""
        try:
            root = psutil.Process(self.process.pid)
            while self.process.poll() is None:
                for child in root.children(recursive=True):
                    self.tree.setdefault(child.pid, child)
                time.sleep(0.05)
        except psutil.NoSuchProcess:
            pass

    def leftovers(self) -> list[psutil.Process]:
        """Processes this run started that are still alive."""
        found = {p.pid: p for p in self.tree.values() if alive(p)}
        for proc in psutil.process_iter():
            try:
                if proc.environ().get(MARKER) == self.run and alive(proc):
                    found[proc.pid] = proc
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return list(found.values())

    @staticmethod
    def _read(pipe, lines: list[str]) -> None:
        with pipe:
            lines.extend(line.rstrip("\n") for line in pipe)

    def wait(self, timeout: float) -> int:
        code = self.process.wait(timeout)
        for reader in self._readers:
            reader.join(5)
        return code

    def output(self) -> str:
        return "\n".join(self.stdout + self.stderr)

    def stop(self) -> None:
        """After a failed test: Ctrl-C first (serve stops its children), then kill -9."""
        signal_then_kill(self.process, signal.SIGINT, 40, group=True)
        for proc in self.leftovers():
            proc.kill()
        self._broker_dir.cleanup()

    def kill_everything(self) -> None:
        """kill -9 serve and every process it started, the broker included: a power cut for
        the system, short of the machine's own page cache."""
        procs = [psutil.Process(self.process.pid), *self.tree.values()]
        for proc in procs:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=10)
        self.wait(10)

    def says_serving(self) -> bool:
        assert self.process.poll() is None, self.output()
        return any("llmq is serving" in line for line in self.stdout)


def on_one_port(
    runs: list[Serve], model: Path, broker_dir: Path, **env: str
) -> tuple[str, Callable[[], Serve]]:
    """A free port's base URL, and what starts `llmq serve` there again and again (each run
    appended to `runs`, returned once it says it serves): `model` at --max-batch 2, every run
    over the one broker folder `broker_dir`, its steps slowed to 20 ms so that generations
    still run at a kill, and `env` added to the environment."""
    port = free_port()
    full_env = {
        **os.environ,
        BROKER_DIR_ENV: str(broker_dir),
        "LLMQ_WORKER_STEP_DELAY_MS": "20",
        **env,
    }
    args = ("--port", str(port), "--models", str(model), "--max-batch", "2")

    def start() -> Serve:
        runs.append(Serve(*args, env=full_env))
        wait_for(runs[-1].says_serving, 180, "llmq serve to say it is serving")
        return runs[-1]

    return f"http://127.0.0.1:{port}", start
