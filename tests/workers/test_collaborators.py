"""The worker's collaborators one at a time, against real Redis (db 14): `Leases`,
`Claims`, `EventWriter`, `RQRegistries`, `JobEnds` and `Presence` each keep their own
state and are tested without a worker loop or an engine."""

from __future__ import annotations

import json

import pytest
import redis
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.results import Result
from rq.serializers import JSONSerializer

from tests.workers.conftest import TINY, stream, submit
from workers import keys, resp, scripts
from workers.claims import CANCELLED, Claim, Claims
from workers.errors import JobFailure
from workers.event_store import RedisEvents
from workers.event_writer import EventWriter
from workers.job_ends import JobEnds
from workers.jobs import ActiveJob
from workers.leases import Leases
from workers.presence import Presence
from workers.recovery import Reaper
from workers.rq_registries import RQRegistries, RQWorker
from workers.running import RunningJobs
from workers.wire.job import COMPLETIONS, FAILED, JobRecord
from workers.wire.worker_info import WorkerInfo

pytestmark = pytest.mark.integration

QUEUE = keys.queue_name(TINY)


def rq_queue(conn) -> Queue:
    return Queue(QUEUE, connection=conn, serializer=JSONSerializer)


def claimed(conn, leases: Leases) -> ActiveJob:
    """A job submitted as the API submits it, claimed by `leases`' worker."""
    job_id = submit(conn, COMPLETIONS, {"prompt": "x"})
    claim = Claims(conn, leases, leases.events).take([rq_queue(conn).key])
    assert claim == Claim(0, job_id, 1)
    record = JobRecord.from_hash(conn.hgetall(keys.job(job_id)))
    rq_job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
    return ActiveJob(record, claim.attempt, leases.name(claim.attempt), rq_job, rq_queue(conn))


def test_claims_take_a_job_under_a_lease_and_give_it_back_to_the_front(conn):
    leases = Leases(RedisEvents(conn), "w", ttl_seconds=10)
    job = claimed(conn, leases)
    assert conn.get(keys.job_lease(job.id)) == b"w:1"
    assert 9_000 < conn.pttl(keys.job_lease(job.id)) <= 10_000
    assert Claims(conn, leases, leases.events).take([rq_queue(conn).key]) is None

    assert Claims(conn, leases, leases.events).give_back(job)
    assert rq_queue(conn).get_job_ids() == [job.id]
    assert not conn.exists(keys.job_lease(job.id)) and not conn.smembers(keys.RUNNING)
    assert not Claims(conn, leases, leases.events).give_back(
        job
    )  # the lease is gone: not ours to give


def test_claims_report_a_cancelled_job_without_a_lease(conn):
    job_id = submit(conn, COMPLETIONS, {"prompt": "x"})
    conn.set(keys.job_cancel(job_id), "1")
    events = RedisEvents(conn)
    claim = Claims(conn, Leases(events, "w", 10), events).take([rq_queue(conn).key])
    assert claim == Claim(0, job_id, CANCELLED)
    assert not conn.exists(keys.job_lease(job_id))


def test_leases_renew_their_own_and_report_the_lost_ones(conn):
    leases = Leases(RedisEvents(conn), "w", ttl_seconds=10)
    kept, lost = claimed(conn, leases), claimed(conn, leases)
    conn.pexpire(keys.job_lease(kept.id), 500)
    conn.set(keys.job_lease(lost.id), "other:2")
    assert leases.renew([kept, lost]) == [lost]
    assert conn.pttl(keys.job_lease(kept.id)) > 9_000
    assert conn.get(keys.job_lease(lost.id)) == b"other:2"
    assert leases.renew([]) == []


def test_two_reapers_that_both_saw_a_lapsed_lease_requeue_the_job_once(conn, monkeypatch):
    job = claimed(conn, Leases(RedisEvents(conn), "w", ttl_seconds=10))
    conn.delete(keys.job_lease(job.id))  # its worker went away
    seen = list(RedisEvents(conn).leases_of_running())
    assert seen == [(job.id, 0)]
    assert Reaper(conn, "r1", 10_000, RedisEvents(conn)).run() == [job.id]
    # the second reaper looked before the first requeued, and takes its lock after
    monkeypatch.setattr(RedisEvents, "leases_of_running", lambda _self: seen)
    assert Reaper(conn, "r2", 10_000, RedisEvents(conn)).run() == []
    assert rq_queue(conn).get_job_ids() == [job.id]
    assert not conn.exists(keys.job_lease(job.id))


def test_a_requeue_of_a_job_no_longer_running_pushes_nothing_and_gives_the_lock_up(conn):
    job = claimed(conn, Leases(RedisEvents(conn), "w", ttl_seconds=10))
    queue_key, rq_key = rq_queue(conn).key, f"rq:job:{job.id}"
    assert scripts.requeue(conn, job.id, "w:1", queue_key, rq_key) == 1
    conn.set(keys.job_lease(job.id), "reaper:late")
    assert scripts.requeue(conn, job.id, "reaper:late", queue_key, rq_key) == 0
    assert rq_queue(conn).get_job_ids() == [job.id]
    assert not conn.exists(keys.job_lease(job.id))


def test_event_writer_flushes_fenced_events_and_reports_lost_jobs_and_cancel_flags(conn):
    leases = Leases(RedisEvents(conn), "w", 10)
    ours, stolen = claimed(conn, leases), claimed(conn, leases)
    conn.set(keys.job_lease(stolen.id), "other:2")
    conn.set(keys.job_cancel(ours.id), "1")
    for job in (ours, stolen):
        job.pending.append(("token", json.dumps({"index": 0, "text": "a"})))
    writer = EventWriter(conn, "w", set(), leases.events)
    assert writer.has_output([ours, stolen])

    flushed = writer.flush([ours, stolen], step_sizes={TINY: 2})
    assert flushed.lost == [stolen] and flushed.finished == []
    assert flushed.cancel_requested == [ours]
    assert ours.pending == [] and ours.written == 1 and len(stream(conn, ours.id)) == 1
    assert stolen.pending and stolen.written == 0 and stream(conn, stolen.id) == []
    assert not writer.has_output([ours])


def test_event_writer_ends_a_job_once_and_only_under_its_lease(conn):
    leases = Leases(RedisEvents(conn), "w", 10)
    job = claimed(conn, leases)
    writer = EventWriter(conn, "w", set(), leases.events)
    body = {"error": {"message": "no", "type": "server_error"}}
    assert writer.end(job, FAILED, body)
    assert [kind for kind, _ in stream(conn, job.id)] == ["error"]
    assert conn.hget(keys.job(job.id), "status") == FAILED.encode()
    assert not conn.exists(keys.job_lease(job.id))
    assert not writer.end(job, FAILED, body)  # the lease went with the end


def token(index: int) -> tuple[str, str]:
    return ("token", json.dumps({"index": index, "text": f"t{index}"}))


def indexes(conn, job_id: str) -> list[int]:
    return [data["index"] for kind, data in stream(conn, job_id) if kind == "token"]


def test_event_writer_sends_a_step_beside_the_next_and_reports_it_on_collect(conn):
    leases = Leases(RedisEvents(conn), "w", 10)
    jobs = [claimed(conn, leases) for _ in range(3)]
    writer = EventWriter(conn, "w", set(), leases.events)
    try:
        for step in range(4):
            for job in jobs:
                job.pending.append(token(step))
            flushed = writer.collect()  # the previous step's outcome, as the loop takes it
            assert flushed.lost == [] and flushed.cancel_requested == []
            writer.send(jobs, {TINY: 3}, background=True)
            assert all(job.pending == [] for job in jobs)  # taken by the step in flight
            assert not writer.has_output(jobs)
        conn.set(keys.job_cancel(jobs[0].id), "1")
        writer.send(jobs, None, background=True)  # waits for step 3 first: one in flight
        flushed = writer.collect()
    finally:
        writer.close()
    assert flushed.cancel_requested == [jobs[0]]
    for job in jobs:
        assert indexes(conn, job.id) == [0, 1, 2, 3] and job.written == 4


def test_event_writer_end_is_fenced_after_the_step_in_flight(conn):
    leases = Leases(RedisEvents(conn), "w", 10)
    job = claimed(conn, leases)
    writer = EventWriter(conn, "w", set(), leases.events)
    job.pending.append(token(0))
    writer.send([job], None, background=True)
    job.pending.append(token(1))  # made by the next step, while the first is in flight
    assert writer.end(job, FAILED, {"error": {"message": "no", "type": "server_error"}})
    writer.close()
    assert [kind for kind, _ in stream(conn, job.id)] == ["token", "token", "error"]
    assert indexes(conn, job.id) == [0, 1]


def test_a_lost_lease_in_flight_gives_the_events_back_and_writes_nothing(conn):
    leases = Leases(RedisEvents(conn), "w", 10)
    job = claimed(conn, leases)
    conn.set(keys.job_lease(job.id), "other:2")
    writer = EventWriter(conn, "w", set(), leases.events)
    job.pending.append(token(0))
    writer.send([job], None, background=True)
    job.pending.append(token(1))
    assert writer.collect().lost == [job]
    writer.close()
    assert job.pending == [token(0), token(1)] and stream(conn, job.id) == []


def test_a_step_whose_reply_was_lost_is_sent_again_as_it_was_and_lands_once(conn, monkeypatch):
    leases = Leases(RedisEvents(conn), "w", 10)
    job = claimed(conn, leases)
    writer = EventWriter(conn, "w", set(), leases.events)
    real_round_trip = resp.round_trip

    def land_then_lose_the_reply(*args, **kwargs):
        real_round_trip(*args, **kwargs)  # it lands in Redis ...
        raise redis.ConnectionError("reply lost")  # ... but the worker never hears so

    monkeypatch.setattr(resp, "round_trip", land_then_lose_the_reply)
    job.pending.append(token(0))
    writer.send([job], None, background=True)
    job.pending.append(token(1))
    with pytest.raises(redis.ConnectionError):
        writer.collect()
    assert writer.has_output([])  # the failed step is kept
    monkeypatch.setattr(resp, "round_trip", real_round_trip)
    flushed = writer.flush([job], None)  # the kept step first, as it was, then the new event
    writer.close()
    assert flushed.lost == [] and indexes(conn, job.id) == [0, 1] and job.written == 2


def registries(conn, name: str = "w") -> RQRegistries:
    worker = RQWorker(
        [QUEUE],
        name=name,
        connection=conn,
        serializer=JSONSerializer,
        on_stop_job=lambda job_id: False,
    )
    worker.register_birth()
    return RQRegistries(worker)


def two_open_jobs(conn) -> tuple[RQRegistries, ActiveJob, ActiveJob]:
    """Worker "w"'s RQ registries with two claimed jobs opened in them (claimed first, then
    opened in that order, as the worker starts them)."""
    rq, leases = registries(conn), Leases(RedisEvents(conn), "w", 10)
    first, second = claimed(conn, leases), claimed(conn, leases)
    for job in (first, second):
        opened(rq, job, conn)
    return rq, first, second


def test_rq_registries_show_several_open_executions_then_a_finished_result(conn):
    rq, first, second = two_open_jobs(conn)
    rq.sync_state()
    started = rq_queue(conn).started_job_registry
    assert sorted(started.get_job_ids()) == sorted([first.id, second.id])
    assert first.rq_job.get_status(refresh=True) == JobStatus.STARTED
    assert conn.hget(rq.worker.key, "current_job").decode() == first.id
    rq.heartbeat()

    rq.close_success(first.rq_job, first.queue, {"job_id": first.id, "status": "finished"})
    assert first.id in rq_queue(conn).finished_job_registry
    result = first.rq_job.latest_result()
    assert result.type == Result.Type.SUCCESSFUL and result.return_value["job_id"] == first.id
    assert started.get_job_ids() == [second.id]
    assert conn.hget(rq.worker.key, "current_job").decode() == second.id
    ttl = conn.ttl(first.rq_job.key)
    assert 0 < ttl <= first.rq_job.get_result_ttl(rq.worker.default_result_ttl)

    rq.close_failure(second.rq_job, second.queue, "JobFailure: no")
    assert second.id in rq_queue(conn).failed_job_registry
    assert second.rq_job.get_status(refresh=True) == JobStatus.FAILED
    assert second.rq_job.latest_result().exc_string == "JobFailure: no"
    assert started.get_job_ids() == []
    assert conn.hget(rq.worker.key, "state") == b"idle"
    counts = conn.hmget(rq.worker.key, "successful_job_count", "failed_job_count")
    assert counts == [b"1", b"1"] and rq.closed == 2


def test_rq_registries_cancel_and_forget(conn):
    rq, cancelled, taken_over = two_open_jobs(conn)
    rq.close_cancelled(cancelled.rq_job, cancelled.queue)
    assert cancelled.id in rq_queue(conn).canceled_job_registry
    assert cancelled.rq_job.get_status(refresh=True) == JobStatus.CANCELED
    rq.forget(taken_over.id)
    rq.sync_state()
    assert conn.hget(rq.worker.key, "state") == b"idle"


def test_the_rq_worker_turns_stop_job_into_its_callback(conn):
    asked: list[str] = []
    worker = RQWorker(
        [QUEUE], name="w", connection=conn, on_stop_job=lambda j: asked.append(j) or True
    )
    message = {"data": json.dumps({"command": "stop-job", "job_id": "abc"}).encode()}
    worker.handle_payload(message)
    worker.handle_payload({"data": b"not json"})
    assert asked == ["abc"]


def test_presence_learns_model_facts_and_notices_a_changed_pool(conn):
    presence = Presence(conn, WorkerInfo(name="w"), {TINY: {"id": TINY}})
    assert presence.learn(TINY, {"chat_template": True})
    assert not presence.learn(TINY, {"chat_template": True}) and not presence.learn(TINY, {})
    assert not presence.learn("unknown", {"chat_template": True})
    assert presence.described(TINY) == {"id": TINY, "chat_template": True}
    presence.publish("idle", [], {TINY: "ready"})
    assert not presence.pool_changed({TINY: "ready"}) and presence.pool_changed({})


def test_presence_tells_a_changed_pool_state_from_moving_step_figures(conn):
    presence = Presence(conn, WorkerInfo(name="w"), {TINY: {"id": TINY}})
    entry = {"state": "ready", "in_flight": 1, "kv_in_use_mb": 1.5, "prefix_cache": {"hits": 2}}
    presence.publish("busy", ["j"], {TINY: entry})
    decoding = {**entry, "kv_in_use_mb": 3.0, "prefix_cache": {"hits": 5}}
    assert presence.pool_changed({TINY: decoding})
    assert not presence.pool_state_changed({TINY: decoding})
    assert presence.pool_state_changed({TINY: {**decoding, "in_flight": 2}})
    assert presence.pool_state_changed({TINY: {**decoding, "state": "loading"}})
    assert presence.pool_state_changed({})


def job_ends(conn) -> tuple[JobEnds, Leases]:
    leases = Leases(RedisEvents(conn), "w", 10)
    running = RunningJobs(pool=None, max_sequences=4)  # type: ignore[arg-type]  # no sequences here
    writer = EventWriter(conn, "w", set(), leases.events)
    return JobEnds(
        conn, running, writer, registries(conn), Claims(conn, leases, leases.events)
    ), leases


def opened(rq: RQRegistries, job: ActiveJob, conn) -> ActiveJob:
    """`job` opened in `rq`, as the worker opens a job it starts (one pipeline)."""
    with conn.pipeline() as pipe:
        rq.open(job.rq_job, pipe)
        pipe.execute()
    return job


def test_job_ends_write_the_stream_before_rq_and_drop_what_is_not_theirs(conn):
    ends, leases = job_ends(conn)
    failed, stolen = (opened(ends.rq, claimed(conn, leases), conn) for _ in range(2))
    ends.fail(failed, JobFailure("the engine failed"))
    assert [kind for kind, _ in stream(conn, failed.id)] == ["error"]
    assert failed.id in rq_queue(conn).failed_job_registry

    conn.set(keys.job_lease(stolen.id), "other:2")
    ends.cancel(stolen)  # not ours: nothing written, RQ's record left to the new owner
    assert stream(conn, stolen.id) == []
    assert stolen.id in rq_queue(conn).started_job_registry.get_job_ids()


def test_job_ends_checkpoint_requeues_and_counts(conn):
    ends, leases = job_ends(conn)
    job = opened(ends.rq, claimed(conn, leases), conn)
    ends.checkpoint(job)
    assert rq_queue(conn).get_job_ids() == [job.id]
    assert conn.hget(keys.METRIC_JOBS, "requeued") == b"1"
    assert conn.hget(ends.rq.worker.key, "state") == b"idle"


def test_job_ends_of_jobs_that_never_ran(conn):
    ends, _ = job_ends(conn)
    job_id = submit(conn, COMPLETIONS, {"prompt": "x"})
    rq_job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
    ends.cancel_queued(job_id, rq_job, rq_queue(conn))
    assert [kind for kind, _ in stream(conn, job_id)] == ["error"]
    assert job_id in rq_queue(conn).canceled_job_registry
    assert conn.hget(keys.METRIC_JOBS, "cancelled") == b"1"


def test_the_worker_is_one_class_in_one_module_holding_its_collaborators():
    from workers.worker import LLMQWorker

    assert LLMQWorker.__bases__ == (object,), "the loop holds its collaborators; no mixins"
    for held in (Claims, Leases, EventWriter, RQRegistries, JobEnds, Presence, RunningJobs):
        assert held.__bases__ == (object,), f"{held.__name__} is one class in one module"
