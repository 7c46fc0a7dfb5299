"""`kill -9` of `llmq serve` alone (the OOM killer, a crashed supervisor): every process it
started goes with it, and a restart on the same data folder finishes every job it had
acknowledged (docs/faults.md F27).

Before, its broker, API, worker and webhook sender ran on as orphans: the orphaned API still
answered /ready, and a restart was refused with "address already in use".

Pass: after the kill, no process of that serve is left (its recorded process tree and every
process carrying its environment marker, the keepers, gunicorn's workers and the broker
included) within the keepers' orphan grace plus slack; a restart serves; a second kill -9
followed at once by a restart (no wait: the race the user hit) serves too, with nothing of
the killed run left; every job answered 202 before either kill finishes with all its tokens.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from tests.faults.conftest import job, submit_async, wait_terminal
from tests.workers.conftest import wait_for
from tests.workers.serve_run import Serve, on_one_port
from workers.supervisor import ORPHAN_GRACE_SECONDS

pytestmark = [pytest.mark.integration, pytest.mark.faults]

JOBS, TOKENS = 6, 60
# the keepers SIGKILL what is left ORPHAN_GRACE_SECONDS after serve is gone; the rest is
# slack for a 2-core machine shared with other test runs (process exits, the /proc scans)
GONE_WITHIN = ORPHAN_GRACE_SECONDS + 20


def names(run: Serve) -> list[str]:
    """What the run's recorded processes run, as one string each (name and command line)."""
    out = []
    for proc in run.tree.values():
        try:
            out.append(" ".join([proc.name(), *proc.cmdline()]))
        except psutil.Error:
            continue
    return out


def kill_9(run: Serve) -> float:
    """kill -9 of serve's own process, nothing else; when it was sent (monotonic)."""
    killed = time.monotonic()
    os.kill(run.process.pid, signal.SIGKILL)
    assert run.wait(10) == -signal.SIGKILL
    return killed


def test_serve_killed_9_leaves_no_process_and_a_restart_finishes_every_accepted_job(
    serve_runs: list[Serve], fault_model: Path, tmp_path: Path
) -> None:
    base, start_serve = on_one_port(serve_runs, fault_model, tmp_path / "broker")

    def start() -> tuple[Serve, float]:
        started = time.monotonic()
        return start_serve(), time.monotonic() - started

    first, took = start()
    print(f"first start: serving after {took:.1f}s")
    accepted = [submit_async(base, TOKENS, prompt=f"tale {i}") for i in range(JOBS)]  # 202s
    wait_for(lambda: job(base, accepted[0]).json()["status"] == "started", 60, "a running job")
    seen = "\n".join(names(first))
    assert "redis-server" in seen, seen  # the broker, its keeper, gunicorn and its workers ...
    assert sum("gunicorn" in line for line in names(first)) >= 2, seen  # ... were recorded

    killed = kill_9(first)
    wait_for(lambda: first.leftovers() == [], GONE_WITHIN, "every process of the killed serve")
    gone = time.monotonic() - killed
    print(f"kill -9 of serve: its {len(first.tree)} processes gone {gone:.1f}s after")

    second, took = start()
    print(f"restart after the kill: serving after {took:.1f}s")
    accepted += [submit_async(base, TOKENS, prompt=f"again {i}") for i in range(JOBS)]
    wait_for(lambda: job(base, accepted[-1]).json()["status"] != "queued", 60, "a running job")

    kill_9(second)  # and at once a new serve, before the keepers have stopped anything
    third, took = start()
    print(f"restart at once after a kill: serving after {took:.1f}s")
    assert second.leftovers() == []  # the new serve stopped what the killed one left first
    assert "address already in use" not in third.output()

    for job_id in accepted:
        body = wait_terminal(base, job_id, 240)
        assert body["status"] == "finished", body
        assert body["result"]["usage"]["completion_tokens"] == TOKENS

    third.process.send_signal(signal.SIGINT)
    assert third.wait(60) == 0, third.output()
    assert third.leftovers() == []
