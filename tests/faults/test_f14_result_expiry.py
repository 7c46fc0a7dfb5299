"""docs/faults.md F14: a finished job polled after its result TTL gets 404 with a clear
message, never a 500 (real Redis of its own, gunicorn, a real worker process).

The TTL is `JOB_TTL_SECONDS` (a day), too long to wait for: the test checks that every key
holding the job carries a TTL no longer than that, then brings each TTL down to 1 s (what
the clock would do a day later) and polls 10 s after the keys are gone, as the row says.
"""

from __future__ import annotations

import time

import httpx
import pytest
import redis

from tests.faults.conftest import submit_async, wait_terminal
from tests.workers.conftest import wait_for
from workers.wire.defaults import JOB_TTL_SECONDS

pytestmark = [pytest.mark.integration, pytest.mark.faults]


def test_f14_finished_job_polled_after_its_ttl_is_a_clear_404(start_system) -> None:
    server, api, _ = start_system(step_delay_ms=0)
    job_id = submit_async(api.base, max_tokens=5)
    assert wait_terminal(api.base, job_id, 60)["status"] == "finished"

    conn = redis.Redis.from_url(server.url)
    held = [k for k in conn.scan_iter(f"*{job_id}*")]
    assert held, "the job left no keys"
    for key in held:
        ttl = conn.ttl(key)
        assert 0 < ttl <= JOB_TTL_SECONDS, f"{key!r} has TTL {ttl}"
        conn.expire(key, 1)
    wait_for(lambda: not list(conn.scan_iter(f"*{job_id}*")), 5, "the job's keys to expire")
    time.sleep(10)  # "poll 10 s after result_ttl"

    for method, path in (
        ("GET", f"/v1/jobs/{job_id}"),
        ("GET", f"/v1/jobs/{job_id}/events"),
        ("POST", f"/v1/jobs/{job_id}/cancel"),
    ):
        response = httpx.request(method, f"{api.base}{path}", timeout=10)
        assert response.status_code in (404, 410), (path, response.status_code, response.text)
        error = response.json()["error"]
        assert job_id in error["message"] and "expired" in error["message"], error
        assert error["code"] == "job_not_found"
    listing = httpx.get(f"{api.base}/v1/jobs", timeout=10)
    assert listing.status_code == 200
    assert job_id not in [j["id"] for j in listing.json()["data"]]
    assert api.server_errors() == []
    conn.close()
