"""docs/faults.md F7 in full: Redis (append-only file, fsynced as llmq serve's broker does)
is shut down while 20 streams are live and started again 5 s later.

Pass: while it is down a POST to /v1 gets 503 + Retry-After within 2.5 s (no 500, no hang);
the open streams are told (`event: error`) and reconnect with Last-Event-ID, and once Redis
is back each resumes with no token missing and none repeated; the workers serve again
within 10 s of the restart; every job ends finished; the access log holds no 5xx but 503s.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.faults.conftest import (
    MODEL,
    Follower,
    assert_no_gap_no_repeat,
    submit_async,
    wait_ready,
    wait_terminal,
)
from tests.workers.conftest import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.faults]

STREAMS, TOKENS = 20, 200


def test_f7_redis_restart_during_20_live_streams(start_system) -> None:
    server, api, workers = start_system(persistent=True, workers=2, step_delay_ms=40)
    jobs = [submit_async(api.base, TOKENS, prompt=f"CANARY-7f3a tale {i}") for i in range(STREAMS)]
    deadline = time.monotonic() + 120
    followers = [Follower(api.base, j, deadline) for j in jobs]
    logs = {j: follower.log for j, follower in zip(jobs, followers, strict=True)}
    wait_for(lambda: all(len(logs[j].tokens()) >= 5 for j in jobs), 60, "tokens on all streams")

    server.shutdown()
    down_at = time.monotonic()
    latencies = []
    for _ in range(3):  # a POST while Redis is down: 503 + Retry-After, quickly
        started = time.monotonic()
        response = httpx.post(
            f"{api.base}/v1/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 2},
            timeout=10,
        )
        latencies.append(time.monotonic() - started)
        assert response.status_code == 503, response.text
        assert int(response.headers["Retry-After"]) > 0
        assert response.json()["error"]["code"] == "broker_down"
    assert max(latencies) <= 2.5, latencies
    time.sleep(max(0.0, 5 - (time.monotonic() - down_at)))
    server.start()
    up_at = time.monotonic()
    wait_ready(api, 10)

    for follower in followers:
        follower.join(max(1.0, deadline - time.monotonic()))
    for job_id in jobs:
        log = logs[job_id]
        assert log.ended == "done", (job_id, log.errors[-3:])
        assert_no_gap_no_repeat(log, TOKENS)
        assert wait_terminal(api.base, job_id, 10)["status"] == "finished"
    # the workers write again within 10 s: the first token each stream got after the restart
    writing_again = [min(t for t in log.arrived if t > up_at) - up_at for log in logs.values()]
    ready_after = max(writing_again)
    assert ready_after < 10, writing_again
    resumed = sum(1 for log in logs.values() if log.attempts > 1)
    assert resumed == STREAMS, "every stream was cut by the outage and resumed"
    told = [log for log in logs.values() if any(_broker_down(e) for e in log.errors)]
    assert len(told) == STREAMS, "every open stream got event: error (broker_down)"
    for worker in workers:
        worker.assert_alive()
    assert api.server_errors() == [], api.server_errors()
    # F17 under F7: the outage logged, the prompts never (API and worker logs)
    for output in [api.output()] + [w.output() for w in workers]:
        assert "CANARY" not in output
    print(
        f"F7: 503 in {max(latencies) * 1000:.0f} ms max; every stream had events again "
        f"{ready_after:.2f}s after the restart; reconnects per stream "
        f"{sorted(log.attempts for log in logs.values())}; "
        f"all {STREAMS} finished in {time.monotonic() - up_at:.1f}s after the restart"
    )


def _broker_down(error: dict) -> bool:
    return (error.get("error") or {}).get("code") == "broker_down"
