"""docs/faults.md F8: Redis loses everything (no AOF, no RDB) while jobs stream: shut down
mid-generation and started again empty 5 s later.

Pass: no 500 from the API at any point; a lost job's GET is a 404 that says so; every SSE
client gets `event: error` within 30 s; the same API processes (never restarted) and the
same worker serve a new job to the end once Redis is back.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.faults.conftest import (
    EventLog,
    follow_once,
    job,
    submit_async,
    wait_ready,
    wait_terminal,
)
from tests.workers.conftest import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.faults]

STREAMS, TOKENS = 4, 200  # 40 ms a step: ~8 s of generation, cut after ~1 s


def test_f8_redis_loses_its_data_mid_stream(start_system) -> None:
    server, api, [worker] = start_system(step_delay_ms=40)
    jobs = [submit_async(api.base, TOKENS, prompt=f"story {i}") for i in range(STREAMS)]
    logs = {job_id: EventLog() for job_id in jobs}
    first_error: dict[str, float] = {}

    def follow(job_id: str) -> None:
        log = logs[job_id]

        def seen(message) -> None:
            if message.event == "error":
                first_error.setdefault(job_id, time.monotonic())

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and log.ended is None:
            follow_once(api.base, job_id, log, on_message=seen)
            if log.errors and log.errors[-1].get("status") == 404:
                return  # the job is gone, and the API says so
            time.sleep(0.2)

    threads = [threading.Thread(target=follow, args=(j,), daemon=True) for j in jobs]
    for thread in threads:
        thread.start()
    wait_for(lambda: all(len(logs[j].tokens()) >= 10 for j in jobs), 30, "tokens on every stream")

    server.shutdown()  # no persistence: everything in it is gone
    lost_at = time.monotonic()
    down = httpx.post(
        f"{api.base}/v1/completions",
        json={"model": "tiny-faults", "prompt": "x", "max_tokens": 2},
        timeout=10,
    )
    assert down.status_code == 503 and down.headers["Retry-After"], down.text
    time.sleep(5)
    server.start()

    for thread in threads:
        thread.join(60)
    for job_id in jobs:
        assert job_id in first_error, f"no event: error for {job_id}: {logs[job_id].errors}"
        assert first_error[job_id] - lost_at < 30
        response = job(api.base, job_id)
        assert response.status_code == 404, response.text
        assert "expired" in response.json()["error"]["message"]
    latency = max(first_error.values()) - lost_at
    print(f"F8: every stream got event: error within {latency:.2f}s of the loss")

    # the same API and worker recover: the worker registers again, a new job finishes
    wait_ready(api, 30)
    worker.assert_alive()
    new = submit_async(api.base, 5)
    assert wait_terminal(api.base, new, 60)["status"] == "finished"
    assert api.process.poll() is None
    assert api.server_errors() == [], api.server_errors()
