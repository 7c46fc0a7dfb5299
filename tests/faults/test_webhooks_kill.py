"""docs/faults.md F24: `llmq webhooks` killed -9 (its whole process group, RQ's scheduler
included) in the middle of a burst of deliveries, started again while the receiver is down,
the receiver back a few seconds later: every event arrives, none is lost; counted by
`webhook-id`, at most the one POST in flight at the kill arrives twice (a receiver dedupes
it by that id, which Standard Webhooks makes the same on every attempt)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import redis

from bench.webhooks import CountingReceiver, end_jobs, expected_id, notifying_jobs, start_webhooks
from workers import keys
from workers.wire import webhooks as wire
from workers.wire.webhook_jobs import dead_deliveries

pytestmark = [pytest.mark.integration]

EVENTS = 400
ENV = {
    "LLMQ_WEBHOOK_ALLOW": "127.0.0.1",
    "LLMQ_WEBHOOK_RETRY_INTERVALS": ",".join(["1", "1"] + ["2"] * 30),
}


def test_webhooks_killed_mid_burst_and_receiver_down_lose_nothing(fault_redis) -> None:
    server = fault_redis()
    conn = redis.Redis.from_url(server.url)
    receiver = CountingReceiver()
    receiver.up()
    endpoint = wire.create_endpoint(conn, receiver.url, ["response.cancelled"])
    receiver.secret = endpoint.secret
    procs = start_webhooks(server.url, 1, ENV)
    try:
        ids = notifying_jobs(conn, EVENTS)
        wanted = {expected_id(j) for j in ids}
        end_jobs(conn, ids)
        assert receiver.wait(lambda: len(receiver.counts) >= EVENTS // 4, 60)
        os.killpg(procs[0].pid, signal.SIGKILL)  # the process and RQ's scheduler it forked
        procs[0].wait(10)
        receiver.down()
        killed_at = len(receiver.counts)
        assert killed_at < EVENTS, "the burst ended before the kill: nothing was tested"
        procs += start_webhooks(server.url, 1, ENV)
        time.sleep(4)  # attempts meet a closed port and are rescheduled
        receiver.up()
        assert receiver.wait(lambda: wanted <= receiver.counts.keys(), 120), (
            f"{len(wanted - receiver.counts.keys())} of {EVENTS} events never arrived"
        )
        time.sleep(2)  # a late second arrival
        with receiver.lock:
            twice = [i for i in wanted if receiver.counts[i] > 1]
        assert len(twice) <= 1, twice  # only what was in flight at the kill
        assert receiver.bad_signatures == 0
        assert dead_deliveries(conn) == []
        assert conn.xlen(keys.WEBHOOK_OUTBOX) == 0  # every entry dispatched and acknowledged
        pending = conn.xpending(keys.WEBHOOK_OUTBOX, keys.WEBHOOK_OUTBOX_GROUP)
        assert pending["pending"] == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        receiver.down()
        conn.close()
