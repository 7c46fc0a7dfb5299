"""docs/faults.md F9: kill -9 the gunicorn process serving a job's event stream.

Pass: the client reconnects (to the other process, or to the one gunicorn starts in its
place) and resumes from Last-Event-ID with no token missing and none repeated; the
generation itself is not cancelled (an API crash is not a client disconnect): the job
finishes on its first attempt with every token.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from tests.faults.conftest import Follower, assert_no_gap_no_repeat, submit_async, wait_terminal
from tests.workers.conftest import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.faults]

TOKENS = 200  # 40 ms a step: ~8 s


def _serving_process(master: psutil.Process, port: int) -> psutil.Process:
    """The gunicorn worker holding the one open client connection on `port`."""
    for child in master.children():
        for conn in child.net_connections(kind="tcp"):
            if conn.laddr.port == port and conn.raddr and conn.status == "ESTABLISHED":
                return child
    raise AssertionError("no gunicorn process holds the stream's connection")


def test_f9_api_process_killed_mid_stream(start_system) -> None:
    api = start_system(processes=2, step_delay_ms=40).api
    job_id = submit_async(api.base, TOKENS)
    follower = Follower(api.base, job_id, time.monotonic() + 90)
    log = follower.log
    wait_for(lambda: len(log.tokens()) >= 20, 30, "20 tokens on the stream")

    master = psutil.Process(api.process.pid)
    victim = _serving_process(master, api.port)
    seen_at_kill = len(log.tokens())
    os.kill(victim.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    follower.join(90)

    assert log.ended == "done", log.errors[-3:]
    assert log.attempts >= 2, "the stream was not cut by the kill"
    assert log.transport_errors >= 1
    assert_no_gap_no_repeat(log, TOKENS)
    assert seen_at_kill < TOKENS, "the job had ended before the kill"
    resumed = [m for attempt, m in log.messages if attempt > 1 and m.event == "token"]
    assert resumed and resumed[0].json()["index"] <= TOKENS - 1
    final = wait_terminal(api.base, job_id, 10)
    assert final["status"] == "finished" and final["attempts"] == 1  # never cancelled/re-run
    assert final["result"]["usage"]["completion_tokens"] == TOKENS
    assert api.process.poll() is None  # the master lives on and replaced its worker
    assert not victim.is_running()
    assert api.server_errors() == []
    first_after = next(i for i, (attempt, _) in enumerate(log.messages) if attempt > 1)
    gap = log.arrived[first_after] - killed_at
    assert gap < 5, f"the stream resumed {gap:.1f}s after the kill"
    print(
        f"F9: killed at token {seen_at_kill}; resumed at index {resumed[0].json()['index']} "
        f"{gap:.2f}s after the kill, {log.attempts} connections in all"
    )
