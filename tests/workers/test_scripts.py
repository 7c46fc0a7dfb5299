"""The Lua scripts behind claims and fenced writes, against real Redis."""

from __future__ import annotations

import pytest

from tests.workers.conftest import TINY, stream, submit
from workers import keys, scripts
from workers.wire.job import COMPLETIONS

pytestmark = pytest.mark.integration

QUEUES = [f"rq:queue:{keys.queue_name(TINY)}", f"rq:queue:{keys.queue_name(TINY, keys.BATCH)}"]


def test_claim_takes_the_first_queue_first_and_marks_the_job_running(conn):
    later = submit(conn, COMPLETIONS, {"prompt": "b"}, kind=keys.BATCH)
    first = submit(conn, COMPLETIONS, {"prompt": "i"})
    assert scripts.claim(conn, QUEUES, "w", 10_000) == (0, first, 1)
    assert conn.sismember(keys.RUNNING, first)
    assert conn.get(keys.job_lease(first)) == b"w:1"
    assert 9_000 < conn.pttl(keys.job_lease(first)) <= 10_000
    assert scripts.claim(conn, QUEUES, "w", 10_000) == (1, later, 1)
    assert scripts.claim(conn, QUEUES, "w", 10_000) is None


def test_claim_reports_cancelled_and_missing_jobs_without_running_them(conn):
    cancelled = submit(conn, COMPLETIONS, {"prompt": "c"})
    conn.set(keys.job_cancel(cancelled), "1")
    assert scripts.claim(conn, QUEUES, "w", 10_000) == (0, cancelled, scripts.CLAIMED_CANCELLED)
    missing = submit(conn, COMPLETIONS, {"prompt": "m"})
    conn.delete(keys.job(missing))
    assert scripts.claim(conn, QUEUES, "w", 10_000) == (0, missing, scripts.CLAIMED_MISSING)
    assert not conn.smembers(keys.RUNNING)
    assert not conn.exists(keys.job_lease(cancelled), keys.job_lease(missing))


def test_append_is_fenced_by_the_lease_and_the_stream_length(conn):
    job_id = submit(conn, COMPLETIONS, {"prompt": "x"})
    scripts.claim(conn, QUEUES, "w", 10_000)
    events = [("token", '{"index": 0}')]
    assert scripts.append(conn, job_id, "other:1", 0, events) is None
    assert scripts.append(conn, job_id, "w:1", 3, events) is None  # stream is not as assumed
    first = scripts.append(conn, job_id, "w:1", 0, events, {"completion_tokens": "1"}, ttl=60)
    assert first and len(stream(conn, job_id)) == 1
    assert conn.hget(keys.job(job_id), "completion_tokens") == b"1"
    assert 0 < conn.ttl(keys.job_events(job_id)) <= 60


def test_a_retried_append_is_not_applied_twice(conn):
    job_id = submit(conn, COMPLETIONS, {"prompt": "x"})
    scripts.claim(conn, QUEUES, "w", 10_000)
    events = [("token", '{"index": 0}'), ("done", '{"id": "cmpl"}')]
    landed = scripts.append(conn, job_id, "w:1", 0, events, {"status": "finished"}, final=True)
    assert not conn.exists(keys.job_lease(job_id)) and not conn.smembers(keys.RUNNING)
    retried = scripts.append(conn, job_id, "w:1", 0, events, {"status": "finished"}, final=True)
    assert retried == landed and len(stream(conn, job_id)) == 2
    assert conn.hget(keys.METRIC_JOBS, "finished") == b"1"  # the end is counted once


def test_only_the_write_that_ends_a_job_counts_it(conn):
    job_id = submit(conn, COMPLETIONS, {"prompt": "x"})
    scripts.claim(conn, QUEUES, "w", 10_000)
    scripts.append(conn, job_id, "w:1", 0, [("token", '{"index": 0}')], {"status": "started"})
    assert not conn.exists(keys.METRIC_JOBS)
    error = [("error", '{"error": {}}')]
    assert scripts.append(conn, job_id, "x:1", 1, error, {"status": "failed"}, True) is None
    assert not conn.exists(keys.METRIC_JOBS)  # a fenced-out end counts nothing
    scripts.append(conn, job_id, "w:1", 1, error, {"status": "failed"}, final=True)
    assert conn.hgetall(keys.METRIC_JOBS) == {b"failed": b"1"}


def test_requeue_puts_the_job_back_in_front_only_for_the_lease_holder(conn):
    job_id = submit(conn, COMPLETIONS, {"prompt": "x"})
    scripts.claim(conn, QUEUES, "w", 10_000)
    other = submit(conn, COMPLETIONS, {"prompt": "y"})
    rq_key = f"rq:job:{job_id}"
    assert scripts.requeue(conn, job_id, "w:9", QUEUES[0], rq_key) == 0
    assert scripts.requeue(conn, job_id, "w:1", QUEUES[0], rq_key) == 1
    assert conn.lrange(QUEUES[0], 0, -1) == [job_id.encode(), other.encode()]
    assert conn.hget(keys.job(job_id), "status") == b"queued"
    assert conn.hget(rq_key, "status") == b"queued"
    assert not conn.exists(keys.job_lease(job_id)) and not conn.smembers(keys.RUNNING)


def test_claim_takes_the_lowest_priority_first_interactive_before_batch(conn):
    """Levels below 0 come before the queue itself, above 0 after it; equal priorities keep
    their arrival order; every interactive job comes before every batch job."""
    order = [
        ("batch -9", keys.BATCH, -9),
        ("later 3", keys.INTERACTIVE, 3),
        ("plain a", keys.INTERACTIVE, 0),
        ("urgent -2", keys.INTERACTIVE, -2),
        ("plain b", keys.INTERACTIVE, 0),
        ("urgent -2 again", keys.INTERACTIVE, -2),
        ("most urgent", keys.INTERACTIVE, -7),
    ]
    ids = {
        submit(conn, COMPLETIONS, {"prompt": name}, kind=kind, priority=p): name
        for name, kind, p in order
    }
    taken = []
    while (claim := scripts.claim(conn, QUEUES, "w", 10_000, kind_ranks=[0, 1])) is not None:
        taken.append(ids[claim[1]])
    assert taken == [
        "most urgent",
        "urgent -2",
        "urgent -2 again",
        "plain a",
        "plain b",
        "later 3",
        "batch -9",
    ]
    # emptied levels are dropped from the level sets; nothing waits anywhere
    assert not conn.exists(keys.queue_levels(keys.queue_name(TINY)))
    assert not conn.exists(keys.queue_levels(keys.queue_name(TINY, keys.BATCH)))


def test_without_kind_ranks_priority_orders_across_queues(conn):
    plain = submit(conn, COMPLETIONS, {"prompt": "i"})
    urgent_batch = submit(conn, COMPLETIONS, {"prompt": "b"}, kind=keys.BATCH, priority=-1)
    assert scripts.claim(conn, QUEUES, "w", 10_000) == (1, urgent_batch, 1)
    assert scripts.claim(conn, QUEUES, "w", 10_000) == (0, plain, 1)


def test_requeue_puts_a_job_back_at_the_front_of_its_priority_level(conn):
    first = submit(conn, COMPLETIONS, {"prompt": "x"}, priority=4)
    second = submit(conn, COMPLETIONS, {"prompt": "y"}, priority=4)
    plain = submit(conn, COMPLETIONS, {"prompt": "z"})
    assert scripts.claim(conn, QUEUES, "w", 10_000) == (0, plain, 1)
    assert scripts.claim(conn, QUEUES, "w", 10_000) == (0, first, 1)
    assert scripts.claim(conn, QUEUES, "w", 10_000) == (0, second, 1)
    rq_key = f"rq:job:{first}"
    assert scripts.requeue(conn, first, "w:1", QUEUES[0], rq_key) == 1
    level = f"rq:queue:{keys.level_queue_name(keys.queue_name(TINY), 4)}"
    assert conn.lrange(level, 0, -1) == [first.encode()] and conn.llen(QUEUES[0]) == 0
    assert conn.zrange(keys.queue_levels(keys.queue_name(TINY)), 0, -1) == [b"4"]
    assert conn.sismember("rq:queues", level)
    late = submit(conn, COMPLETIONS, {"prompt": "w"})  # priority 0 still goes first
    assert scripts.claim(conn, QUEUES, "w", 10_000) == (0, late, 1)
    assert scripts.claim(conn, QUEUES, "w", 10_000) == (0, first, 2)


def _claimed(conn, count: int) -> list[str]:
    ids = [submit(conn, COMPLETIONS, {"prompt": f"s{i}"}) for i in range(count)]
    for job_id in ids:
        assert scripts.claim(conn, QUEUES, "w", 10_000)[1] == job_id
    return ids


def test_one_step_call_fences_each_job_on_its_own_lease_and_reads_cancel_flags(conn):
    ours, stolen, idle = _claimed(conn, 3)
    conn.set(keys.job_lease(stolen), "other:2")
    conn.set(keys.job_cancel(idle), "1")
    token = [("token", '{"index": 0}')]
    entries = [
        scripts.step_entry(
            ours, "w:1", scripts.STEP_FIRST_WRITE, 0, token, {"completion_tokens": "1"}
        ),
        scripts.step_entry(stolen, "w:1", scripts.STEP_WRITE, 0, token),
        scripts.step_entry(idle, "w:1", scripts.STEP_CHECK_ONLY),
    ]
    assert scripts.write_step(conn, entries, ttl=60) == [
        (True, False),
        (False, False),
        (True, True),
    ]
    assert len(stream(conn, ours)) == 1 and stream(conn, stolen) == []
    assert conn.hget(keys.job(ours), "completion_tokens") == b"1"
    assert 0 < conn.ttl(keys.job_events(ours)) <= 60  # the first write sets the TTLs
    stale = scripts.step_entry(ours, "w:1", scripts.STEP_WRITE, 0, [("token", '{"index": 9}')])
    assert scripts.write_step(conn, [stale]) == [(False, False)]  # the stream moved on


def test_a_final_step_write_ends_the_job_once_even_when_retried(conn):
    [job_id] = _claimed(conn, 1)
    events = [("token", '{"index": 0}'), ("done", '{"id": "cmpl"}')]
    final = scripts.step_entry(job_id, "w:1", scripts.STEP_FINAL, 0, events, {"status": "finished"})
    assert scripts.write_step(conn, [final]) == [(True, False)]
    assert not conn.exists(keys.job_lease(job_id)) and not conn.smembers(keys.RUNNING)
    assert scripts.write_step(conn, [final]) == [(True, False)]  # its reply was lost: sent again
    assert len(stream(conn, job_id)) == 2
    assert conn.hget(keys.METRIC_JOBS, "finished") == b"1"


def test_the_step_script_is_loaded_again_after_redis_lost_its_scripts(conn):
    [job_id] = _claimed(conn, 1)
    conn.script_flush()  # as a restarted Redis, or a replica promoted by a failover
    entry = scripts.step_entry(job_id, "w:1", scripts.STEP_WRITE, 0, [("token", '{"index": 0}')])
    assert scripts.write_step(conn, [entry]) == [(True, False)]
    assert conn.script_exists(scripts.WRITE_STEP.sha) == [True]


def test_the_claim_names_the_lease_key_as_keys_job_lease_does(conn):
    ids = _claimed(conn, 40)  # 40 ids: many event buckets
    assert all(conn.exists(keys.job_lease(job_id)) for job_id in ids)
    assert len({keys.event_bucket(job_id) for job_id in ids}) > keys.EVENT_BUCKETS // 2
