"""docs/faults.md F26: a burst of background responses, each to be told by a signed webhook,
while a worker running some of them is killed -9 and the whole API is killed -9 and started
again.

Every response ends (another worker resumes what the killed one ran), and the receiver gets
exactly one delivery of each response's terminal event, with a valid signature: the event
goes into the outbox in the same write that ends the job (`workers/wire/webhooks.py`), so
neither the worker's death nor the API's can lose it, and `llmq webhooks` (not killed here)
delivers each once.
"""

from __future__ import annotations

import time

import httpx
import pytest
import redis

from bench.webhooks import CountingReceiver, start_webhooks, stop
from tests.faults.conftest import MODEL, kill_api
from tests.workers.conftest import wait_for
from workers import keys
from workers.wire import webhooks as wire

pytestmark = [pytest.mark.integration, pytest.mark.faults]

RESPONSES = 24
# 20 ms a step: response i runs for (16 + 9 i) steps, so they end one after another over
# about 4.5 s, and the kills fall while some have been told and others still run
TOKENS, MORE_TOKENS = 16, 9  # the fault model's context is 256 tokens
ENV = {"LLMQ_WEBHOOK_ALLOW": "127.0.0.1", "LLMQ_WEBHOOK_RETRY_INTERVALS": "1,1,2,2,2,2,2,2"}
EVENTS = ["response.completed", "response.incomplete", "response.failed", "response.cancelled"]


def test_f26_background_responses_webhooks_across_a_worker_kill_and_an_api_restart(
    start_system, start_api
) -> None:
    system = start_system(workers=2, step_delay_ms=20)
    receiver = CountingReceiver()
    receiver.up()
    created = httpx.post(
        f"{system.api.base}/admin/webhooks",
        json={"url": receiver.url, "events": EVENTS},
        timeout=10,
    )
    assert created.status_code == 201, created.text
    receiver.secret = created.json()["secret"]
    webhooks = start_webhooks(system.server.url, 1, ENV)
    conn = redis.Redis.from_url(system.server.url)
    try:
        ids = []
        for i in range(RESPONSES):
            body = {
                "model": MODEL,
                "input": f"story {i}",
                "max_output_tokens": TOKENS + MORE_TOKENS * i,
                "temperature": 0,
                "background": True,
            }
            reply = httpx.post(f"{system.api.base}/v1/responses", json=body, timeout=10)
            assert reply.status_code == 200, reply.text
            ids.append(reply.json()["id"])

        def busy_workers() -> set[str]:
            with conn.pipeline(transaction=False) as pipe:
                for response_id in ids:
                    pipe.hmget(keys.job(response_id), "status", "worker")
                states = pipe.execute()
            return {w.decode() for status, w in states if status == b"started" and w}

        wait_for(
            lambda: receiver.distinct() >= 2 and busy_workers(),
            60,
            "two webhooks delivered and a response running",
        )
        victim = next(w for w in system.workers if w.name in busy_workers())
        victim.kill_tree()
        kill_api(system.api)
        api = start_api(system.server.url, 1)
        delivered_at_kill = receiver.distinct()
        assert delivered_at_kill < RESPONSES, "every response had ended before the kills"

        def ended() -> dict[str, str] | None:
            statuses = {}
            for response_id in ids:
                reply = httpx.get(f"{api.base}/v1/responses/{response_id}", timeout=10)
                assert reply.status_code == 200, reply.text
                status = reply.json()["status"]
                if status in ("queued", "in_progress"):
                    return None
                statuses[response_id] = status
            return statuses

        deadline = time.monotonic() + 120
        statuses = None
        while statuses is None and time.monotonic() < deadline:
            statuses = ended()
            if statuses is None:
                time.sleep(0.5)
        assert statuses is not None, "a response never ended"
        assert set(statuses.values()) <= {"completed", "incomplete"}, statuses
        wanted = {wire.event_id(f"response.{s}", i) for i, s in statuses.items()}
        assert receiver.wait(lambda: wanted <= receiver.counts.keys(), 60), (
            f"{len(wanted - receiver.counts.keys())} of {RESPONSES} webhooks never arrived"
        )
        time.sleep(2)  # a late second delivery would show now
        with receiver.lock:
            assert receiver.counts == dict.fromkeys(wanted, 1), receiver.counts
            assert receiver.bad_signatures == 0
        attempts = [
            httpx.get(f"{api.base}/v1/jobs/{i}", timeout=10).json()["attempts"] for i in ids
        ]
        assert max(attempts) >= 2, "the worker's kill cut no response's run"
        assert api.server_errors() == []
        print(
            f"F26: {delivered_at_kill} of {RESPONSES} delivered at the kills; "
            f"{sum(a >= 2 for a in attempts)} responses resumed by another worker; "
            f"every webhook once"
        )
    finally:
        stop(webhooks)
        receiver.down()
        conn.close()
