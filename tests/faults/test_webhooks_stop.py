"""`llmq webhooks` asked to stop while its Redis is unreachable (every server of a Sentinel
master gone): it stops at once with status 0 and says so, whether RQ's work loop or
workers/cli.py's retry of a run that lost Redis had the signal (a signal there used to
reach RQ's handler for a worker no longer running, and `llmq serve` killed the process
after its grace)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.faults.sentinel import SentinelCluster
from tests.workers.conftest import wait_for

pytestmark = [pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]


def test_webhooks_stops_on_sigterm_with_no_master(tmp_path: Path) -> None:
    cluster = SentinelCluster(tmp_path, replicas=1)
    log_path = tmp_path / "webhooks.log"
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmq", "webhooks"],
            cwd=REPO,
            env={**env, **cluster.env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for(lambda: "webhooks:" in log_path.read_text(errors="replace"), 60, "started")
        for server in cluster.servers:
            server.kill()
        wait_for(
            lambda: "No master found" in log_path.read_text(errors="replace"),
            60,
            "the Sentinels to say the master is gone",
        )
        asked = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(20)
        output = log_path.read_text(errors="replace")
        assert status == 0, output[-3000:]
        assert time.monotonic() - asked < 20
        assert "webhooks: stopped" in output
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        cluster.stop()
