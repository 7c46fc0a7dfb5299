"""docs/faults.md F24: `llmq webhooks` killed -9 (its whole process group, RQ's scheduler
included) in the middle of a burst of deliveries, started again while the receiver is down,
the receiver back a few seconds later: every event arrives, none is lost; counted by
`webhook-id`, at most the one POST in flight at the kill arrives twice (a receiver dedupes
it by that id, which Standard Webhooks makes the same on every attempt).

And the two states a kill can leave a delivery in, each forced, each taken over within the
bound of workers/webhooks/reaper.py (the dead process's lease, then a sweep): dequeued by
RQ's BLMOVE and not yet registered as a run (where F24 once lost an event for 412 s: RQ
alone waits for a maintenance pass, every 405 s on an idle worker), and POSTed with no
answer yet (RQ alone: the job's timeout + 60 s).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import redis
from rq.job import Job
from rq.serializers import JSONSerializer

from bench.webhooks import CountingReceiver, end_jobs, expected_id, notifying_jobs
from tests.faults.conftest import print_log_if_failed
from tests.workers.conftest import REPO, wait_for
from workers import keys
from workers.webhooks.dispatcher import delivery_id
from workers.webhooks.reaper import LEASE_SECONDS, REAP_SECONDS
from workers.wire import webhooks as wire
from workers.wire.webhook_jobs import dead_deliveries, webhook_queue

pytestmark = [pytest.mark.integration]

EVENTS = 400
ENV = {
    "LLMQ_WEBHOOK_ALLOW": "127.0.0.1",
    "LLMQ_WEBHOOK_RETRY_INTERVALS": ",".join(["1", "1"] + ["2"] * 30),
}
# A delivery in flight at a kill is back on the queue LEASE + REAP s after it (or after the
# next process starts, whichever is later), then delivered at once: the process's start
# (seconds on a busy 2-core machine) and that delivery get 20 s more. RQ alone: > 60 s.
BOUND = LEASE_SECONDS + REAP_SECONDS + 20
# Outcome waits, not timings: each costs nothing when things go fast.
START_WAIT = 60  # a process's start and its first deliveries: ~3 s idle
DONE_WAIT = 120  # retries 1-2 s apart and one takeover (12 s); 10x for a busy machine


def test_webhooks_killed_mid_burst_and_receiver_down_lose_nothing(fault_redis, webhooks) -> None:
    server = fault_redis()
    conn = redis.Redis.from_url(server.url)
    receiver, endpoint = subscribed_receiver(conn)
    procs = [webhooks(server.url, ENV)]
    try:
        wanted = ended_jobs(conn, EVENTS)
        assert receiver.wait(lambda: len(receiver.counts) >= EVENTS // 4, START_WAIT)
        os.killpg(procs[0].pid, signal.SIGKILL)  # the process and RQ's scheduler it forked
        procs[0].wait(10)
        receiver.down()
        killed_at = len(receiver.counts)
        assert killed_at < EVENTS, "the burst ended before the kill: nothing was tested"
        procs.append(webhooks(server.url, ENV))
        # attempts meet the closed port and are rescheduled: seen in the delivery log
        wait_for(lambda: refused(conn, endpoint.id) >= 5, START_WAIT, "refused attempts")
        receiver.up()
        assert_all_arrive(conn, receiver, wanted, endpoint.id)
        wait_for(lambda: drained(conn), DONE_WAIT, "nothing left to deliver")
        with receiver.lock:
            twice = [i for i in wanted if receiver.counts[i] > 1]
        assert len(twice) <= 1, twice  # only what was in flight at the kill
        assert receiver.bad_signatures == 0
        assert dead_deliveries(conn) == []
        assert conn.xlen(keys.WEBHOOK_OUTBOX) == 0  # every entry dispatched and acknowledged
        pending = conn.xpending(keys.WEBHOOK_OUTBOX, keys.WEBHOOK_OUTBOX_GROUP)
        assert pending["pending"] == 0
    finally:
        receiver.down()
        conn.close()


def test_a_delivery_dequeued_and_not_yet_run_at_the_kill_arrives_within_the_bound(
    fault_redis, webhooks
) -> None:
    """The kill lands between RQ's BLMOVE (the job in the queue's intermediate list) and the
    MULTI that registers its run: the process group is stopped (SIGSTOP) as soon as the
    list holds a job without a run, then killed."""
    server = fault_redis()
    conn = redis.Redis.from_url(server.url)
    receiver, endpoint = subscribed_receiver(conn)
    queue = webhook_queue(conn)
    procs = [webhooks(server.url, ENV)]
    try:
        wanted = ended_jobs(conn, EVENTS)
        assert receiver.wait(lambda: len(receiver.counts) >= 10, START_WAIT)
        stuck = stop_between_dequeue_and_run(conn, procs[0], lambda: len(receiver.counts) < EVENTS)
        os.killpg(procs[0].pid, signal.SIGKILL)
        procs[0].wait(10)
        killed = time.time()
        [event_id] = [e for e in wanted if delivery_id(e, endpoint.id) == stuck]
        assert event_id not in receiver.counts
        procs.append(webhooks(server.url, ENV))
        assert_all_arrive(conn, receiver, wanted, endpoint.id)
        took = receiver.first_at[event_id] - killed
        assert took <= BOUND, f"the delivery dequeued at the kill arrived {took:.1f} s after it"
        wait_for(lambda: drained(conn), DONE_WAIT, "nothing left to deliver")
        with receiver.lock:
            assert all(receiver.counts[i] == 1 for i in wanted)  # no POST was in flight
        assert queue.intermediate_queue.get_job_ids() == [] and dead_deliveries(conn) == []
    finally:
        receiver.down()
        conn.close()


def test_a_delivery_posted_and_unanswered_at_the_kill_is_sent_again_within_the_bound(
    fault_redis, webhooks
) -> None:
    server = fault_redis()
    conn = redis.Redis.from_url(server.url)
    receiver = HoldingReceiver()
    endpoint = wire.create_endpoint(conn, receiver.url, ["response.cancelled"])
    env = {**ENV, "LLMQ_WEBHOOK_TIMEOUT_SECONDS": "60"}  # RQ alone: 60 + 10 + 60 s
    procs = [webhooks(server.url, env)]
    try:
        [job_id] = notifying_jobs(conn, 1)
        end_jobs(conn, [job_id])
        wait_for(lambda: receiver.arrivals, START_WAIT, "the first POST")
        os.killpg(procs[0].pid, signal.SIGKILL)  # its POST is held, unanswered
        procs[0].wait(10)
        killed = time.time()
        procs.append(webhooks(server.url, env))
        wait_for(lambda: len(receiver.arrivals) == 2, DONE_WAIT, "the POST sent again")
        (first_id, _), (second_id, second_at) = receiver.arrivals
        assert first_id == second_id == expected_id(job_id)  # the same webhook-id: deduped
        took = second_at - killed
        assert took <= BOUND, f"the POST in flight at the kill was sent again {took:.1f} s after"
        delivery = delivery_id(first_id, endpoint.id)
        wait_for(lambda: drained(conn), DONE_WAIT, "nothing left to deliver")
        job = Job.fetch(delivery, connection=conn, serializer=JSONSerializer)
        assert job.get_status() == "finished" and len(receiver.arrivals) == 2
        log = wire.read_deliveries(conn, endpoint.id)[::-1]
        assert [(a["attempt"], a["status"]) for a in log] == [(1, None), (2, 204)]
    finally:
        receiver.close()
        conn.close()


# ---------------------------------------------------------------- helpers


@pytest.fixture
def webhooks(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[Callable[[str, dict[str, str]], subprocess.Popen[bytes]]]:
    """Starts `llmq webhooks` processes, each in its own session (a kill of its group
    reaches RQ's scheduler) and logging to a file; kills what is left after the test and
    prints their logs when it failed."""
    started: list[tuple[subprocess.Popen[bytes], Path]] = []

    def start(url: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
        path = tmp_path / f"webhooks-{len(started)}.log"
        with path.open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "llmq", "webhooks", "--log-level", "INFO"],
                cwd=REPO,
                env={**os.environ, **env, "REDIS_URL": url},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        started.append((proc, path))
        return proc

    yield start
    for n, (proc, path) in enumerate(started):
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        print_log_if_failed(request, f"llmq webhooks #{n}", path.read_text(errors="replace"))


class HoldingReceiver:
    """Records each POST's `webhook-id` and arrival time as it arrives; holds the first
    one unanswered (until `close`), answers the others 204."""

    def __init__(self) -> None:
        self.arrivals: list[tuple[str, float]] = []
        self.release = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                self.rfile.read(int(self.headers.get("content-length", 0)))
                receiver.arrivals.append((self.headers.get("webhook-id", ""), time.time()))
                if len(receiver.arrivals) == 1:
                    receiver.release.wait()
                    return
                self.send_response(204)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def subscribed_receiver(conn: redis.Redis) -> tuple[CountingReceiver, wire.Endpoint]:
    """A `CountingReceiver`, up, and its endpoint subscribed to response.cancelled."""
    receiver = CountingReceiver()
    receiver.up()
    endpoint = wire.create_endpoint(conn, receiver.url, ["response.cancelled"])
    receiver.secret = endpoint.secret
    return receiver, endpoint


def ended_jobs(conn: redis.Redis, count: int) -> set[str]:
    """`count` jobs that notify the webhooks, ended: the event ids the receiver must get."""
    ids = notifying_jobs(conn, count)
    wanted = {expected_id(j) for j in ids}
    end_jobs(conn, ids)
    return wanted


def assert_all_arrive(
    conn: redis.Redis, receiver: CountingReceiver, wanted: set[str], endpoint_id: str
) -> None:
    assert receiver.wait(lambda: wanted <= receiver.counts.keys(), DONE_WAIT), (
        f"{len(wanted - receiver.counts.keys())} of {EVENTS} events never arrived: "
        + where(conn, wanted - receiver.counts.keys(), endpoint_id)
    )


def stop_between_dequeue_and_run(conn: redis.Redis, proc: Any, running: Any) -> str:
    """SIGSTOP `proc`'s group the moment the queue's intermediate list holds a delivery with
    no registered run (the window between RQ's BLMOVE and its next MULTI; a few round trips,
    so found within a few hundred polls); the delivery's id. SIGCONT and poll again when the
    stop came too late, while `running()` (the burst still under way)."""
    queue = webhook_queue(conn)
    while running():
        if not conn.llen(queue.intermediate_queue_key):
            continue
        os.killpg(proc.pid, signal.SIGSTOP)
        listed = [j.decode() for j in conn.lrange(queue.intermediate_queue_key, 0, -1)]
        runs = {j for j, _ in queue.started_job_registry.get_job_and_execution_ids()}
        waiting = [j for j in listed if j not in runs]
        if waiting:
            return waiting[0]
        os.killpg(proc.pid, signal.SIGCONT)
    raise AssertionError("the burst ended before a stop landed in the window")


def refused(conn: redis.Redis, endpoint_id: str) -> int:
    """Attempts the endpoint's delivery log records without an answer (a closed port)."""
    return sum(1 for a in wire.read_deliveries(conn, endpoint_id) if a["status"] is None)


def drained(conn: redis.Redis) -> bool:
    """Nothing is left that could POST: no delivery queued, dequeued, running or waiting
    for a retry, and no outbox entry."""
    queue = webhook_queue(conn)
    return not (
        queue.count
        or conn.llen(queue.intermediate_queue_key)
        or queue.started_job_registry.get_job_and_execution_ids(cleanup=False)
        or queue.scheduled_job_registry.count
        or conn.xlen(keys.WEBHOOK_OUTBOX)
    )


def where(conn: redis.Redis, missing: set[str], endpoint_id: str) -> str:
    """Where each missing event's delivery is in RQ's structures: a failure's evidence."""
    queue = webhook_queue(conn)
    runs = {j for j, _ in queue.started_job_registry.get_job_and_execution_ids(cleanup=False)}
    lines = []
    for event_id in sorted(missing):
        job_id = delivery_id(event_id, endpoint_id)
        places = {
            "queue": job_id in queue.get_job_ids(),
            "intermediate": job_id in queue.intermediate_queue.get_job_ids(),
            "started": job_id in runs,
            "scheduled": job_id in queue.scheduled_job_registry.get_job_ids(),
            "failed": job_id in queue.failed_job_registry.get_job_ids(),
            "finished": job_id in queue.finished_job_registry.get_job_ids(),
        }
        job = Job.fetch_many([job_id], connection=conn, serializer=JSONSerializer)[0]
        state = "no job" if job is None else f"{job.get_status()}, {job.retries_left} retries left"
        lines.append(f"{job_id}: {state}, in {[k for k, v in places.items() if v]}")
    return "\n".join(lines)
