"""Webhooks on a real Redis: the outbox entry each terminal path writes, the dispatcher, and
deliveries to local receivers (signatures the official client accepts, SSRF refusals,
redirects, retries, the dead-letter list)."""

from __future__ import annotations

import ipaddress
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import openai
import pytest
import redis
from rq import Queue
from rq.job import Job
from rq.registry import FailedJobRegistry
from rq.scheduler import RQScheduler
from rq.serializers import JSONSerializer

from api import store
from api.app import create_app
from tests.workers.conftest import TINY, tokens, wait_done, wait_for
from workers import keys
from workers.webhooks import dispatcher as webhooks
from workers.webhooks import process, reaper
from workers.webhooks.delivery import (
    AddressRefused,
    is_allowed,
    is_forbidden,
    resolve,
    signed_headers,
)
from workers.wire import webhook_jobs
from workers.wire import webhooks as wire
from workers.wire.events import ending, write_ending
from workers.wire.job import CANCELLED, COMPLETIONS, FAILED, FINISHED, JOB_FUNCTION, JobRecord

# apart from the worker tests' db 14 (tests/redis_db.py SESSION_DATABASES)
REDIS_URL = os.environ.get("LLMQ_WEBHOOKS_TEST_REDIS_URL", "redis://127.0.0.1:6379/12")
GREEDY = {"model": TINY, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def redis_url() -> str:
    """The worker fixtures (`start_worker`, `conn`) on this module's own db."""
    return REDIS_URL


class Receiver:
    """A local HTTP server that records each POST and answers with `statuses` in turn
    (the last one repeats)."""

    def __init__(self, statuses: list[int] | None = None, location: str = "") -> None:
        self.statuses = list(statuses or [200])
        self.location = location
        self.requests: list[tuple[dict[str, str], bytes]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                receiver.requests.append(({k.lower(): v for k, v in self.headers.items()}, body))
                status = (
                    receiver.statuses.pop(0) if len(receiver.statuses) > 1 else receiver.statuses[0]
                )
                self.send_response(status)
                if receiver.location:
                    self.send_header("Location", receiver.location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receivers() -> Iterator[Any]:
    made: list[Receiver] = []

    def make(statuses: list[int] | None = None, location: str = "") -> Receiver:
        made.append(Receiver(statuses, location))
        return made[-1]

    yield make
    for r in made:
        r.close()


@pytest.fixture
def allow_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMQ_WEBHOOK_ALLOW", "127.0.0.1")
    monkeypatch.setenv("LLMQ_WEBHOOK_RETRY_INTERVALS", "0,0")
    monkeypatch.setenv("LLMQ_WEBHOOK_TIMEOUT_SECONDS", "5")


def notifying_job(
    conn: redis.Redis, notify: bool = True, enqueue: bool = False, **body: Any
) -> str:
    """A job record as the API stores it, marked as a response's (`notify_fields`)."""
    job_id = f"resp_{uuid.uuid4().hex}"
    request = {**GREEDY, "prompt": "hi", "max_tokens": 4, **body}
    record = JobRecord(id=job_id, endpoint=COMPLETIONS, model=TINY, request=request)
    fields = {**record.to_hash(), **(wire.notify_fields() if notify else {})}
    conn.hset(keys.job(job_id), mapping=fields)
    if enqueue:
        queue = Queue(keys.queue_name(TINY), connection=conn, serializer=JSONSerializer)
        queue.enqueue_call(func=JOB_FUNCTION, args=[job_id], job_id=job_id, description=job_id)
    return job_id


def outbox(conn: redis.Redis) -> list[wire.OutboxEntry]:
    return [wire.OutboxEntry.from_entry(i, f) for i, f in conn.xrange(keys.WEBHOOK_OUTBOX)]


def end(conn: redis.Redis, job_id: str, status: str, body: dict[str, Any]) -> None:
    with conn.pipeline() as pipe:
        write_ending(pipe, job_id, status, body)
        pipe.execute()


def deliver_all(conn: redis.Redis, until: Any = None, timeout: float = 20.0) -> None:
    """Dispatch the outbox and run the webhook worker in bursts (its scheduler moving due
    retries) until `until()` holds, or until nothing is left to do."""
    dispatcher = webhooks.Dispatcher(conn, webhook_jobs.WebhookSettings.from_env(), block_ms=10)
    dispatcher.ensure_group()
    queue = webhook_jobs.webhook_queue(conn)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dispatcher.run_once()
        worker = process.WebhookWorker([queue], connection=conn, serializer=JSONSerializer)
        worker.work(burst=True, with_scheduler=True, logging_level="WARNING")
        if until is not None and until():
            return
        if until is None and not queue.count and not queue.scheduled_job_registry.count:
            return
        time.sleep(0.1)
    raise AssertionError("deliveries did not settle in time")


# ---------------------------------------------------------------- the outbox


def test_event_types_follow_status_and_result() -> None:
    length = {"choices": [{"finish_reason": "length"}]}
    assert wire.response_event_type(FINISHED, {"choices": [{"finish_reason": "stop"}]}) == (
        "response.completed"
    )
    assert wire.response_event_type(FINISHED, length) == "response.incomplete"
    assert wire.response_event_type(FINISHED, {"status": "incomplete"}) == "response.incomplete"
    assert wire.response_event_type(FAILED, None) == "response.failed"
    assert wire.response_event_type(CANCELLED, None) == "response.cancelled"
    assert wire.response_event_type("queued", None) is None
    # the final status an entry carries is the type: no result is read
    assert wire.response_event_type(FINISHED, None, "incomplete") == "response.incomplete"
    assert wire.response_event_type(FINISHED, length, "completed") == "response.completed"
    assert wire.response_event_type(CANCELLED, None, "cancelled") == "response.cancelled"
    assert wire.response_event_type(FINISHED, None, "in_progress") is None  # no such event
    assert wire.response_event_type("queued", None, "completed") is None
    assert wire.batch_event_type("expired") == "batch.expired"
    assert wire.batch_event_type("in_progress") is None
    assert wire.event_id("response.completed", "resp_1") == wire.event_id(
        "response.completed", "resp_1"
    )


def test_write_ending_appends_an_outbox_entry_only_for_a_notifying_job(conn) -> None:
    marked, plain = notifying_job(conn), notifying_job(conn, notify=False)
    end(conn, marked, CANCELLED, {"error": {"code": "cancelled"}, "status": 499})
    end(conn, plain, CANCELLED, {"error": {"code": "cancelled"}, "status": 499})
    [entry] = outbox(conn)
    assert (entry.kind, entry.id, entry.status) == ("response", marked, CANCELLED)
    assert entry.response_status == "cancelled"


def test_cancel_while_queued_through_the_api_appends_the_entry(conn) -> None:
    job_id = notifying_job(conn, enqueue=True)
    assert store.cancel(conn, job_id).status == CANCELLED
    [entry] = outbox(conn)
    assert (entry.id, entry.status) == (job_id, CANCELLED)


def test_a_worker_finishing_a_notifying_job_appends_the_entry(conn, start_worker) -> None:
    job_id = notifying_job(conn, enqueue=True, max_tokens=3)
    plain = notifying_job(conn, notify=False, enqueue=True, max_tokens=3)
    start_worker()
    assert wait_done(conn, job_id).status == FINISHED
    assert wait_done(conn, plain).status == FINISHED
    [entry] = outbox(conn)
    assert (entry.id, entry.status) == (job_id, FINISHED)
    assert entry.response_status == "incomplete"  # stopped at max_tokens
    dispatcher = webhooks.Dispatcher(conn, webhook_jobs.WebhookSettings())
    assert dispatcher.event_type(entry) == "response.incomplete"
    conn.hdel(keys.job(job_id), "result")  # the type is the entry's: no record is read
    assert dispatcher.event_type(entry) == "response.incomplete"


def test_a_worker_cancelling_a_running_job_appends_the_entry(conn, start_worker) -> None:
    job_id = notifying_job(conn, enqueue=True, max_tokens=200)
    start_worker(step_delay=0.02)
    wait_for(lambda: len(tokens(conn, job_id)) >= 2, what="a few tokens")
    conn.set(keys.job_cancel(job_id), "1")
    assert wait_done(conn, job_id).status == CANCELLED
    [entry] = outbox(conn)
    assert (entry.id, entry.status, entry.response_status) == (job_id, CANCELLED, "cancelled")


def test_a_worker_failing_a_job_appends_the_entry(conn, start_worker) -> None:
    job_id = notifying_job(conn, enqueue=True, prompt="x" * 5000, max_tokens=4)  # past context
    start_worker()
    assert wait_done(conn, job_id).status == FAILED
    [entry] = outbox(conn)
    assert (entry.id, entry.status, entry.response_status) == (job_id, FAILED, "failed")


@pytest.mark.parametrize("script", ["write_step", "record_step"])
def test_the_step_script_appends_the_entry_at_the_final_write(conn, script) -> None:
    """`scripts._WRITE_STEP` (one Redis) and `cluster_step._RECORD_STEP` (the queue
    Redis's half of a step beside an events cluster, run here on one Redis)."""
    from workers import cluster_step, scripts

    job_id = notifying_job(conn)
    conn.set(keys.job_lease(job_id), "w:1")
    conn.sadd(keys.RUNNING, job_id)
    fields, done = ending(FINISHED, {"choices": [{"finish_reason": "length"}]})
    entry = scripts.step_entry(job_id, "w:1", scripts.STEP_FINAL, 0, [done], fields)
    if script == "write_step":
        assert scripts.write_step(conn, [entry]) == [(True, False)]
    else:
        assert cluster_step.record_step(conn, [entry], [True]) == ["0"]
    assert [(e.id, e.status, e.response_status) for e in outbox(conn)] == [
        (job_id, FINISHED, "incomplete")
    ]


def test_an_entry_written_without_the_final_status_reads_the_jobs_result(conn) -> None:
    """An entry a version before the terminal write carried the response's status wrote:
    `{kind, id, status}` alone; the dispatcher reads the job's result for it."""
    dispatcher = webhooks.Dispatcher(conn, webhook_jobs.WebhookSettings())
    results = {
        "incomplete": {"choices": [{"finish_reason": "length"}]},
        "completed": {"choices": [{"finish_reason": "stop"}]},
    }
    for final, result in results.items():
        job_id = notifying_job(conn)
        conn.hset(keys.job(job_id), mapping={"status": FINISHED, "result": json.dumps(result)})
        fields = {"kind": wire.NOTIFY_RESPONSE, "id": job_id, "status": FINISHED}
        entry = wire.OutboxEntry.from_entry(conn.xadd(keys.WEBHOOK_OUTBOX, fields), fields)
        assert entry.response_status == ""
        assert dispatcher.event_type(entry) == f"response.{final}"
    fields = {"kind": wire.NOTIFY_RESPONSE, "id": notifying_job(conn), "status": FAILED}
    failed = wire.OutboxEntry.from_entry(conn.xadd(keys.WEBHOOK_OUTBOX, fields), fields)
    assert dispatcher.event_type(failed) == "response.failed"


# ---------------------------------------------------------------- delivery


def test_every_delivery_passes_the_official_clients_unwrap(conn, receivers, allow_loopback):
    receiver = receivers()
    endpoint = wire.create_endpoint(conn, receiver.url, ["response.cancelled"])
    job_id = notifying_job(conn)
    end(conn, job_id, CANCELLED, {"error": {"code": "cancelled"}, "status": 499})
    deliver_all(conn, lambda: receiver.requests)

    [(headers, body)] = receiver.requests
    client = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9")
    event = client.webhooks.unwrap(body.decode(), headers, secret=endpoint.secret)
    assert event.type == "response.cancelled" and event.data.id == job_id
    assert headers["webhook-id"] == json.loads(body)["id"] == event.id
    assert json.loads(body) == {
        "object": "event",
        "id": event.id,
        "type": "response.cancelled",
        "created_at": json.loads(body)["created_at"],
        "data": {"id": job_id},
    }
    other = wire.new_secret()
    with pytest.raises(openai.InvalidWebhookSignatureError):
        client.webhooks.unwrap(body.decode(), headers, secret=other)
    with pytest.raises(openai.InvalidWebhookSignatureError):
        client.webhooks.unwrap(
            body.decode().replace(job_id, "resp_x"), headers, secret=endpoint.secret
        )
    old = signed_headers(endpoint.secret, event.id, body.decode(), time.time() - 600)
    with pytest.raises(openai.InvalidWebhookSignatureError):
        client.webhooks.unwrap(body.decode(), old, secret=endpoint.secret)
    [attempt] = wire.read_deliveries(conn, endpoint.id)
    assert attempt["status"] == 200 and attempt["error"] is None and attempt["attempt"] == 1


def test_loopback_is_refused_without_the_allow_list(conn, receivers, monkeypatch):
    monkeypatch.setenv("LLMQ_WEBHOOK_RETRY_INTERVALS", "0")
    receiver = receivers()
    endpoint = wire.create_endpoint(conn, receiver.url, ["response.failed"])
    end(conn, notifying_job(conn), FAILED, {"error": {"code": "x"}, "status": 500})
    deliver_all(conn)
    assert receiver.requests == []
    attempts = wire.read_deliveries(conn, endpoint.id)
    assert len(attempts) == 2 and all("not a public address" in a["error"] for a in attempts)
    with pytest.raises(AddressRefused):
        resolve("http://localhost:1/x")
    assert resolve(receiver.url, ("127.0.0.0/8",)).address == "127.0.0.1"
    assert resolve(receiver.url, ("127.0.0.1",)).address == "127.0.0.1"


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "169.254.169.254",
        "100.64.0.1",
        "0.0.0.0",
        "224.0.0.1",
        "240.0.0.1",
        "::1",
        "::",
        "fe80::1",
        "fc00::1",
        "ff02::1",
        "::ffff:127.0.0.1",
        "::ffff:169.254.169.254",
    ],
)
def test_non_public_addresses_are_forbidden(address: str) -> None:
    assert is_forbidden(ipaddress.ip_address(address))


def test_public_addresses_and_the_allow_list() -> None:
    assert not is_forbidden(ipaddress.ip_address("93.184.215.14"))
    assert not is_forbidden(ipaddress.ip_address("2606:4700::1111"))
    mapped = ipaddress.ip_address("::ffff:10.0.0.5")
    assert is_allowed("x", mapped, ("10.0.0.0/8",))
    assert is_allowed("hooks.internal", ipaddress.ip_address("10.0.0.5"), ("hooks.internal",))
    assert not is_allowed("other", ipaddress.ip_address("10.0.0.5"), ("hooks.internal",))


def test_a_redirect_is_a_failure_and_is_not_followed(conn, receivers, allow_loopback):
    target = receivers()
    redirecting = receivers([302], location=target.url)
    endpoint = wire.create_endpoint(conn, redirecting.url, ["response.failed"])
    end(conn, notifying_job(conn), FAILED, {"error": {"code": "x"}, "status": 500})
    deliver_all(conn)
    assert len(redirecting.requests) == 3 and target.requests == []
    attempts = wire.read_deliveries(conn, endpoint.id)
    assert [a["status"] for a in attempts] == [302, 302, 302]
    assert "redirects are not followed" in attempts[0]["error"]


def test_a_failed_attempt_is_retried_after_its_interval(
    conn, receivers, allow_loopback, monkeypatch
):
    monkeypatch.setenv("LLMQ_WEBHOOK_RETRY_INTERVALS", "1,1")
    receiver = receivers([500, 503, 200])
    endpoint = wire.create_endpoint(conn, receiver.url, ["response.failed"])
    end(conn, notifying_job(conn), FAILED, {"error": {"code": "x"}, "status": 500})
    started = time.monotonic()
    deliver_all(conn, lambda: len(receiver.requests) == 3)
    # two 1 s intervals through RQ's scheduler (it keeps due times in whole seconds)
    assert time.monotonic() - started >= 1
    attempts = wire.read_deliveries(conn, endpoint.id)[::-1]
    assert [(a["attempt"], a["status"]) for a in attempts] == [(1, 500), (2, 503), (3, 200)]
    assert len({h["webhook-id"] for h, _ in receiver.requests}) == 1


def test_the_last_failure_is_dead_lettered_and_can_be_redelivered(conn, receivers, allow_loopback):
    receiver = receivers([500, 500, 500, 200])
    endpoint = wire.create_endpoint(conn, receiver.url, ["response.failed"])
    end(conn, notifying_job(conn), FAILED, {"error": {"code": "x"}, "status": 500})
    deliver_all(conn)
    [dead] = webhook_jobs.dead_deliveries(conn)
    assert len(receiver.requests) == 3 and dead.args[0] == endpoint.id
    api = create_app({"REDIS_CLIENT": conn, "TESTING": True}).test_client()
    [listed] = api.get("/admin/webhooks/dead").get_json()["data"]
    assert listed["delivery"] == dead.id and listed["endpoint_id"] == endpoint.id
    assert listed["type"] == "response.failed" and "HTTP 500" in listed["error"]
    log = api.get(f"/admin/webhooks/{endpoint.id}/deliveries").get_json()["data"]
    assert [(a["attempt"], a["status"]) for a in log] == [(3, 500), (2, 500), (1, 500)]
    assert api.post(f"/admin/webhooks/dead/{dead.id}/redeliver").status_code == 202
    assert not webhook_jobs.redeliver(conn, dead.id)  # not dead any more
    deliver_all(conn)
    assert len(receiver.requests) == 4 and webhook_jobs.dead_deliveries(conn) == []
    failed = FailedJobRegistry(queue=webhook_jobs.webhook_queue(conn))
    assert failed.get_job_ids() == []


def test_dispatching_an_entry_twice_enqueues_its_delivery_once(conn, receivers, allow_loopback):
    receiver = receivers()
    wire.create_endpoint(conn, receiver.url, ["response.failed", "response.cancelled"])
    wire.create_endpoint(conn, receiver.url, ["response.completed"])  # not subscribed
    end(conn, notifying_job(conn), FAILED, {"error": {"code": "x"}, "status": 500})
    [entry] = outbox(conn)
    dispatcher = webhooks.Dispatcher(conn, webhook_jobs.WebhookSettings.from_env())
    assert len(dispatcher.dispatch(entry)) == 1
    assert dispatcher.dispatch(entry) == []
    deliver_all(conn)
    assert len(receiver.requests) == 1


def test_a_delivery_enqueued_under_the_former_function_name_still_runs(
    conn, receivers, allow_loopback
):
    receiver = receivers()
    endpoint = wire.create_endpoint(conn, receiver.url, ["response.failed"])
    event = wire.event_body("response.failed", "resp_old", int(time.time()))
    [former] = process.FORMER_DELIVER_FUNCTIONS
    queue = webhook_jobs.webhook_queue(conn)
    job = queue.enqueue(former, endpoint.id, event, 0, job_id="whd_former")
    deliver_all(conn, lambda: receiver.requests)
    assert [json.loads(body)["id"] for _, body in receiver.requests] == [event["id"]]
    job = Job.fetch(job.id, conn, serializer=JSONSerializer)
    assert job.get_status() == "finished" and job.func_name == webhooks.DELIVER_FUNCTION
    other = queue.enqueue("workers.keys.job", "x", job_id="whd_other")  # still refused (F19)
    deliver_all(conn)
    assert Job.fetch(other.id, conn, serializer=JSONSerializer).get_status() == "failed"


def test_an_entry_a_live_dispatcher_held_past_the_claim_time_is_taken(
    conn, receivers, allow_loopback
):
    receiver = receivers()
    wire.create_endpoint(conn, receiver.url, ["response.failed"])
    end(conn, notifying_job(conn), FAILED, {"error": {"code": "x"}, "status": 500})
    stuck = webhooks.Dispatcher(conn, webhook_jobs.WebhookSettings.from_env(), consumer="stuck")
    stuck.ensure_group()
    assert stuck._read()  # read, never acknowledged, though its process lives
    alive = webhooks.Dispatcher(conn, webhook_jobs.WebhookSettings.from_env(), block_ms=10)
    alive.own_pending = False
    assert alive.run_once() == 0  # not idle long enough yet
    webhooks.CLAIM_IDLE_MS, saved = 0, webhooks.CLAIM_IDLE_MS
    try:
        assert alive.run_once() == 1
    finally:
        webhooks.CLAIM_IDLE_MS = saved
    assert conn.xlen(keys.WEBHOOK_OUTBOX) == 0
    deliver_all(conn)
    assert len(receiver.requests) == 1


# ---------------------------------------------------------------- takeover after a death


class Clock:
    """The reaper's monotonic clock, moved by hand: what it must have watched for how long
    is then exact, with no sleep."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def dispatched(conn: redis.Redis, receiver: Receiver) -> tuple[wire.Endpoint, str]:
    """An endpoint of `receiver` and one delivery to it on the webhook queue."""
    endpoint = wire.create_endpoint(conn, receiver.url, ["response.failed"])
    end(conn, notifying_job(conn), FAILED, {"error": {"code": "x"}, "status": 500})
    dispatcher = webhooks.Dispatcher(conn, webhook_jobs.WebhookSettings.from_env(), "d", 10)
    dispatcher.ensure_group()
    [entry] = outbox(conn)
    [delivery] = dispatcher.dispatch(entry)
    return endpoint, delivery


def run_by_a_worker_that_dies(conn: redis.Redis, name: str, posted: bool = True) -> Job:
    """What an `llmq webhooks` process named `name` (on another host: its pid is nowhere
    looked at) leaves when killed during its delivery: the job dequeued as RQ's SimpleWorker
    dequeues it, its run registered, and (`posted`) its start recorded, the POST sent and
    never answered; its lease, taken at its start, then no longer renewed."""
    reaper.Presence(conn, name, lease_s=LEASE).renew()
    queue = webhook_jobs.webhook_queue(conn)
    worker = process.WebhookWorker([queue], connection=conn, serializer=JSONSerializer, name=name)
    job, _ = Queue.dequeue_any([queue], None, connection=conn, serializer=JSONSerializer)
    worker.prepare_execution(job)  # SimpleWorker.execute_job's first step
    if posted:
        worker.prepare_job_execution(job, remove_from_intermediate_queue=True)
    return job


LEASE = 1.0  # the dead worker's lease in these tests (LEASE_SECONDS in production)


@pytest.mark.parametrize("posted", [True, False], ids=["posting", "before-its-post"])
def test_a_delivery_whose_worker_died_is_redelivered_once_its_lease_lapses(
    conn, receivers, allow_loopback, posted
):
    receiver = receivers()
    endpoint, delivery = dispatched(conn, receiver)
    killed = time.monotonic()  # its lease's last renewal is just after this
    job = run_by_a_worker_that_dies(conn, "webhooks.elsewhere.7.dead", posted)
    retries = job.retries_left
    here = reaper.Reaper(conn, "webhooks.here.1.live", lease_s=LEASE)
    assert here.sweep("webhooks.here.1.live").started == 0  # its lease holds: alive
    # the lease lapses LEASE s after its last renewal; a sweep every REAP_SECONDS then
    # finds it: wait for that outcome, bounded at 30 s for a busy machine
    wait_for(lambda: here.sweep("webhooks.here.1.live").started, 30, "the takeover")
    taken_after = time.monotonic() - killed
    assert LEASE <= taken_after <= LEASE + reaper.REAP_SECONDS + 10
    queue = webhook_jobs.webhook_queue(conn)
    assert queue.get_job_ids() == [delivery]  # at the front, now: no retry interval
    assert queue.started_job_registry.get_job_and_execution_ids(cleanup=False) == []
    assert queue.intermediate_queue.get_job_ids() == []
    deliver_all(conn, lambda: receiver.requests)
    assert len(receiver.requests) == 1
    log = wire.read_deliveries(conn, endpoint.id)[::-1]
    if posted:  # the dead run was an attempt: logged, and a retry spent
        assert [(a["attempt"], a["error"]) for a in log] == [(1, reaper.DIED), (2, None)]
        assert Job.fetch(delivery, conn, serializer=JSONSerializer).retries_left == retries - 1
    else:  # it died before its POST: nothing was attempted
        assert [(a["attempt"], a["error"]) for a in log] == [(1, None)]
    assert here.sweep("webhooks.here.1.live") == reaper.Swept()  # taken once


def test_a_dead_workers_last_attempt_is_dead_lettered(conn, receivers, allow_loopback):
    receiver = receivers()
    _, delivery = dispatched(conn, receiver)
    job = Job.fetch(delivery, conn, serializer=JSONSerializer)
    job.retries_left = 0
    job.save()
    run_by_a_worker_that_dies(conn, "webhooks.elsewhere.8.dead")
    conn.delete(keys.webhook_alive("webhooks.elsewhere.8.dead"))  # its lease lapsed
    assert reaper.Reaper(conn, "webhooks.here.1.live").sweep("x").started == 1
    [dead] = webhook_jobs.dead_deliveries(conn)
    assert dead.id == delivery and receiver.requests == []


def test_a_delivery_dequeued_by_a_worker_that_died_before_its_run_is_put_back(
    conn, receivers, allow_loopback
):
    receiver = receivers()
    _, delivery = dispatched(conn, receiver)
    queue = webhook_jobs.webhook_queue(conn)
    # RQ's dequeue, BLMOVE into the intermediate list, then a kill -9 before the worker
    # registers its run (found there by tests/faults/test_webhooks_kill.py)
    assert Queue.lmove(conn, queue.key, None)[1].decode() == delivery
    clock = Clock()
    here = reaper.Reaper(conn, "webhooks.here.1.live", lease_s=10, clock=clock)
    assert here.sweep("x").dequeued == 0  # seen: a live worker holds one here briefly
    clock.now += 9.9
    assert here.sweep("x").dequeued == 0
    clock.now += 0.1
    assert here.sweep("x").dequeued == 1
    assert queue.get_job_ids() == [delivery] and queue.intermediate_queue.get_job_ids() == []
    deliver_all(conn, lambda: receiver.requests)
    assert len(receiver.requests) == 1
    assert Job.fetch(delivery, conn, serializer=JSONSerializer).get_status() == "finished"


def test_a_delivery_a_live_worker_dequeued_is_left_to_it(conn, receivers, allow_loopback):
    receiver = receivers()
    _, delivery = dispatched(conn, receiver)
    queue = webhook_jobs.webhook_queue(conn)
    clock = Clock()
    here = reaper.Reaper(conn, "webhooks.here.1.live", lease_s=10, clock=clock)
    Queue.lmove(conn, queue.key, None)
    assert here.sweep("x").dequeued == 0  # seen between its dequeue and its run
    worker = process.WebhookWorker([queue], connection=conn, serializer=JSONSerializer)
    reaper.Presence(conn, worker.name, lease_s=60).renew()
    worker.prepare_execution(Job.fetch(delivery, conn, serializer=JSONSerializer))
    clock.now += 60
    assert here.sweep("x") == reaper.Swept()  # its run is registered, its lease alive
    assert queue.get_job_ids() == []


def test_outbox_entries_of_a_dispatcher_whose_lease_lapsed_are_claimed_at_once(
    conn, receivers, allow_loopback
):
    receiver = receivers()
    wire.create_endpoint(conn, receiver.url, ["response.failed"])
    end(conn, notifying_job(conn), FAILED, {"error": {"code": "x"}, "status": 500})
    settings = webhook_jobs.WebhookSettings.from_env()
    dead = webhooks.Dispatcher(conn, settings, consumer="webhooks.elsewhere.9.dead")
    reaper.Presence(conn, dead.consumer, lease_s=60).renew()
    dead.ensure_group()
    assert dead._read()  # read, never acknowledged: its process is killed now
    live = webhooks.Dispatcher(conn, settings, consumer="webhooks.here.1.live", block_ms=10)
    live.own_pending = False
    here = reaper.Reaper(conn, live.consumer)
    assert here.sweep(live.consumer).entries == 0  # its lease holds
    conn.delete(keys.webhook_alive(dead.consumer))  # it lapsed: nobody renewed it
    assert here.sweep(live.consumer).entries == 1
    live.own_pending = True  # as dispatch_forever sets it after a claim
    assert live.run_once() == 1
    names = [i["name"] for i in conn.xinfo_consumers(keys.WEBHOOK_OUTBOX, "dispatchers")]
    assert names == [live.consumer.encode()] and conn.xlen(keys.WEBHOOK_OUTBOX) == 0
    deliver_all(conn)
    assert len(receiver.requests) == 1


def test_a_scheduler_lock_whose_holder_stopped_beating_is_dropped(conn) -> None:
    queue = webhook_jobs.webhook_queue(conn)
    dying = RQScheduler([queue], connection=conn, name="sched-dying")
    assert dying.acquire_locks() == {keys.WEBHOOK_QUEUE}
    dying.register_birth()
    clock = Clock()
    here = reaper.Reaper(conn, "webhooks.here.1.live", lease_s=10, clock=clock)
    assert not here.drop_dead_scheduler_lock()
    for _ in range(3):  # alive: its heartbeat moves (RQ's is every second)
        clock.now += 9
        time.sleep(0.002)  # a new heartbeat's timestamp (microseconds) differs
        dying.heartbeat()
        assert not here.drop_dead_scheduler_lock()
    clock.now += 9.9  # killed: no heartbeat since
    assert not here.drop_dead_scheduler_lock()
    clock.now += 0.1
    assert here.drop_dead_scheduler_lock()
    taker = RQScheduler([queue], connection=conn, name="sched-taker")
    assert taker.acquire_locks() == {keys.WEBHOOK_QUEUE}


def test_a_process_lease_lives_while_renewed_and_goes_at_its_stop(conn) -> None:
    presence = reaper.Presence(conn, "webhooks.here.2.x", lease_s=5, renew_s=0.05)
    presence.start()
    assert reaper.alive(conn, [presence.name, "other"]) == {presence.name: True, "other": False}
    assert 0 < conn.pttl(presence.key) <= 5000
    conn.pexpire(presence.key, 300)
    wait_for(lambda: conn.pttl(presence.key) > 300, 10, "a renewal")
    presence.stop()
    assert not conn.exists(presence.key)


def test_a_deleted_endpoint_drops_its_deliveries(conn, receivers, allow_loopback):
    receiver = receivers()
    endpoint = wire.create_endpoint(conn, receiver.url, ["response.failed"])
    end(conn, notifying_job(conn), FAILED, {"error": {"code": "x"}, "status": 500})
    webhooks.Dispatcher(conn, webhook_jobs.WebhookSettings.from_env()).ensure_group()
    webhooks.Dispatcher(conn, webhook_jobs.WebhookSettings.from_env(), block_ms=10).run_once()
    assert wire.delete_endpoint(conn, endpoint.id)
    deliver_all(conn)
    assert receiver.requests == [] and webhook_jobs.dead_deliveries(conn) == []


def test_settings_from_the_environment() -> None:
    default = webhook_jobs.WebhookSettings.from_env({})
    assert default.intervals[:3] == (1, 2, 4) and default.intervals[-1] == 3600
    assert 23 * 3600 < sum(default.intervals) < 25 * 3600
    custom = webhook_jobs.WebhookSettings.from_env(
        {"LLMQ_WEBHOOK_RETRY_INTERVALS": "0, 5", "LLMQ_WEBHOOK_ALLOW": "10.0.0.0/8, a.b"}
    )
    assert custom.intervals == (0, 5) and custom.allow == ("10.0.0.0/8", "a.b")
    with pytest.raises(webhook_jobs.WebhookSettingsError):
        webhook_jobs.WebhookSettings.from_env({"LLMQ_WEBHOOK_TIMEOUT_SECONDS": "0"})
