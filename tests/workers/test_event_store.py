"""workers/event_store.py on one Redis: the mode is read once from the client (`events_of`),
and `RedisEvents` leaves the lease to the scripts that claim and requeue a job, writes a
job's end fenced by its lease, and deletes a stream with the records' writes. The cluster's
`ClusterEvents` is tested on a real cluster in tests/workers/test_events_cluster.py."""

from __future__ import annotations

import pytest
import redis

from tests.workers.conftest import submit
from workers import keys
from workers.event_store import RedisEvents, events_of
from workers.jobs import ActiveJob
from workers.leases import Leases
from workers.wire.events import decode_event, ending
from workers.wire.job import COMPLETIONS, FINISHED, JobRecord

pytestmark = pytest.mark.integration

QUEUES = [f"rq:queue:{keys.queue_name('tiny-llama')}"]


def test_one_redis_is_one_mode_object(conn: redis.Redis) -> None:
    events = events_of(conn)
    assert isinstance(events, RedisEvents) and events.queue is events.client is conn
    # `EventsSettings.connect` gives the queue's client itself without a cluster
    same = events_of(conn, conn)
    assert isinstance(same, RedisEvents) and same.queue is same.client is conn


def test_the_claim_takes_the_lease_and_renewal_reports_each_lease(conn: redis.Redis) -> None:
    events = RedisEvents(conn)
    job_id = submit(conn, COMPLETIONS, {"prompt": "hi"})
    claimed = events.claim(QUEUES, Leases(events, "w", 10), None)
    assert claimed == (0, job_id, 1)
    assert conn.get(keys.job_lease(job_id)) == b"w:1" and conn.pttl(keys.job_lease(job_id)) > 0
    assert events.renew([(job_id, "w:1"), (job_id, "other:1")], 30_000) == [True, False]
    assert conn.pttl(keys.job_lease(job_id)) > 20_000
    assert list(events.leases_of_running()) == [(job_id, 1)]
    assert events.requeue_fence(job_id, "w:1") == "w:1"  # the requeue script checks it
    assert events.finish_from_stream(job_id) is None
    events.drop_lease(job_id)
    assert list(events.leases_of_running()) == [(job_id, 0)]


def test_a_jobs_end_is_fenced_by_its_lease_and_its_stream_goes_with_the_records_writes(
    conn: redis.Redis,
) -> None:
    events = RedisEvents(conn)
    job_id = submit(conn, COMPLETIONS, {"prompt": "hi"})
    events.claim(QUEUES, Leases(events, "w", 10), None)
    fields, done = ending(FINISHED, {"id": "cmpl", "choices": []})
    job = ActiveJob(JobRecord(job_id, COMPLETIONS, "tiny-llama", {}), 1, "other:1", None, None)
    assert not events.end(job, [done], fields, 3)  # not its lease
    job.lease = "w:1"
    assert events.end(job, [done], fields, 3)
    [(_, entry)] = conn.xrange(keys.job_events(job_id))
    assert decode_event(entry)[0] == "done" and not conn.sismember(keys.RUNNING, job_id)
    with conn.pipeline() as pipe:
        events.delete_stream(pipe, job_id)
        assert conn.exists(keys.job_events(job_id))  # not before the pipeline runs
        pipe.execute()
    assert not conn.exists(keys.job_events(job_id))
