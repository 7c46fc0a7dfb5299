"""docs/faults.md F12: a TCP proxy between a worker and Redis stalls mid-job (bytes held, not
refused) for 10 s, and on until the job's lease has expired and another worker has taken
it over; then it flows again, and the first worker's late writes reach Redis.

Pass: the job never runs in two places at once. Every token event carries the attempt that
wrote it: the stream holds each index exactly once, the first attempt's events all come
before the second's and none after them (its late appends were refused by the lease
fence), the job finishes, and the stalled worker lives on.
"""

from __future__ import annotations

import time

import pytest
import redis

from tests.faults.conftest import (
    Follower,
    StallingProxy,
    assert_no_gap_no_repeat,
    submit_async,
    wait_ready,
    wait_terminal,
)
from tests.workers.conftest import stream, wait_for
from workers import keys

pytestmark = [pytest.mark.integration, pytest.mark.faults]

TOKENS, STALL_S = 200, 10.0


def test_f12_a_stalled_worker_never_runs_a_job_beside_its_successor(
    fault_redis, start_api, start_workers
) -> None:
    server = fault_redis(persistent=False)
    proxy = StallingProxy(server.port)
    try:
        api = start_api(server.url)
        [stalled] = start_workers(proxy.url(), step_delay_ms=40)
        wait_ready(api)
        job_id = submit_async(api.base, TOKENS)
        follower = Follower(api.base, job_id, time.monotonic() + 120)
        log = follower.log
        wait_for(lambda: len(log.tokens()) >= 20, 30, "20 tokens from the first worker")
        [successor] = start_workers(server.url, step_delay_ms=40)
        conn = redis.Redis.from_url(server.url)
        wait_for(lambda: conn.scard(keys.WORKERS) >= 2, 30, "the second worker to register")

        proxy.stall()
        stalled_at = time.monotonic()
        time.sleep(STALL_S)
        wait_for(lambda: _attempts(conn, job_id) >= 2, 30, "another worker to take the job")
        taken_after = time.monotonic() - stalled_at
        proxy.resume()

        follower.join(120)
        final = wait_terminal(api.base, job_id, 30)
        assert final["status"] == "finished" and final["attempts"] == 2
        tokens = [data for kind, data in stream(conn, job_id) if kind == "token"]
        assert [t["index"] for t in tokens] == list(range(TOKENS))  # the stream first:
        assert_no_gap_no_repeat(log, TOKENS)  # a gap only the client saw is the relay's
        attempts = [t["attempt"] for t in tokens]
        switch = attempts.index(2)
        assert set(attempts[:switch]) == {1} and set(attempts[switch:]) == {2}, attempts
        entries = conn.xlen(keys.job_events(job_id))
        time.sleep(3)  # the stalled worker's held writes have arrived by now: none landed
        assert conn.xlen(keys.job_events(job_id)) == entries
        stalled.assert_alive()
        successor.assert_alive()
        assert api.server_errors() == []
        print(
            f"F12: stalled {taken_after:.1f}s until the takeover; attempt 1 wrote indices "
            f"0..{switch - 1}, attempt 2 wrote {switch}..{TOKENS - 1}, no overlap"
        )
        conn.close()
    finally:
        proxy.close()


def _attempts(conn: redis.Redis, job_id: str) -> int:
    return int(conn.hget(keys.job(job_id), "attempts") or 0)
