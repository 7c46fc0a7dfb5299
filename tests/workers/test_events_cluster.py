"""The token path on a real local Redis Cluster (`LLMQ_EVENTS_CLUSTER`): each job's stream and
lease on the cluster in one hash slot, its record, the running set and the metrics on the
queue Redis (`workers.cluster_step`), and a job's end exactly once across the two."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from redis.cluster import RedisCluster

from tests.events_cluster import flush, local_cluster
from tests.workers.conftest import record, submit
from workers import cluster_step, keys, scripts
from workers.wire.broker import EventsSettings
from workers.wire.events import decode_event

pytestmark = pytest.mark.integration

COMPLETIONS = "/v1/completions"
QUEUES = [f"rq:queue:{keys.queue_name('tiny-llama')}"]
TOKEN = ("token", '{"index": 0}')


@pytest.fixture(scope="module")
def cluster_ports(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[int]]:
    with local_cluster(tmp_path_factory.mktemp("cluster")) as ports:
        yield ports


@pytest.fixture
def events(cluster_ports: list[int]) -> Iterator[RedisCluster]:
    flush(cluster_ports)
    settings = EventsSettings.from_env({"LLMQ_EVENTS_CLUSTER": f"127.0.0.1:{cluster_ports[0]}"})
    client = settings.connect(redis.Redis())
    yield client
    client.close()
    flush(cluster_ports)


def _claim(conn: redis.Redis, events: RedisCluster) -> str:
    job_id = submit(conn, COMPLETIONS, {"prompt": "hi"})
    index, claimed, attempt = scripts.claim(conn, QUEUES, "w", 0)
    assert (claimed, attempt) == (job_id, 1)
    events.set(keys.job_lease(job_id), "w:1", px=10_000)
    return job_id


def _stream(events: RedisCluster, job_id: str) -> list[str]:
    return [decode_event(f)[0] for _, f in events.xrange(keys.job_events(job_id))]


def test_a_jobs_stream_and_lease_share_a_slot_and_the_claim_leaves_the_lease_to_the_cluster(
    conn, events
):
    job_id = _claim(conn, events)
    assert events.keyslot(keys.job_events(job_id)) == events.keyslot(keys.job_lease(job_id))
    assert not conn.exists(keys.job_lease(job_id))  # lease TTL 0: none on the queue Redis
    assert conn.sismember(keys.RUNNING, job_id)
    slots = {events.keyslot(keys.job_events(f"job{i}")) for i in range(64)}
    nodes = {events.get_node_from_key(keys.job_events(f"job{i}")).name for i in range(64)}
    assert len(slots) > 32 and len(nodes) == 3  # jobs spread over every shard


def test_a_step_is_fenced_by_the_clusters_lease_and_reads_cancel_flags_on_the_queue_redis(
    conn, events
):
    ours, stolen, idle = (_claim(conn, events) for _ in range(3))
    events.set(keys.job_lease(stolen), "other:2")
    conn.set(keys.job_cancel(idle), "1")
    entries = [
        scripts.step_entry(ours, "w:1", scripts.STEP_FIRST_WRITE, 0, [TOKEN], {"n": "1"}),
        scripts.step_entry(stolen, "w:1", scripts.STEP_WRITE, 0, [TOKEN], {"n": "1"}),
        scripts.step_entry(idle, "w:1", scripts.STEP_CHECK_ONLY),
    ]
    reply = cluster_step.write_step(events, conn, entries, ttl=60)
    assert scripts.step_results(reply) == [(True, False), (False, False), (True, True)]
    assert _stream(events, ours) == ["token"] and _stream(events, stolen) == []
    assert conn.hget(keys.job(ours), "n") == b"1" and conn.hget(keys.job(stolen), "n") is None
    assert 0 < events.ttl(keys.job_events(ours)) <= 60 and 0 < conn.ttl(keys.job(ours)) <= 60
    assert not conn.exists(keys.job_events(ours))  # nothing of the stream on the queue Redis
    stale = scripts.step_entry(ours, "w:1", scripts.STEP_WRITE, 0, [("token", '{"index": 9}')])
    assert scripts.step_results(cluster_step.write_step(events, conn, [stale])) == [(False, False)]


def _final(job_id: str) -> tuple[list[str], list[object]]:
    done = ("done", '{"id": "cmpl", "usage": {"prompt_tokens": 2, "completion_tokens": 1}}')
    return scripts.step_entry(
        job_id, "w:1", scripts.STEP_FINAL, 0, [TOKEN, done], {"status": "finished"}, 3, False
    )


def test_a_final_step_ends_the_job_once_even_when_sent_again(conn, events):
    job_id = _claim(conn, events)
    for _ in range(2):  # the second as after a lost reply: the step is sent again as it was
        reply = cluster_step.write_step(events, conn, [_final(job_id)])
        assert scripts.step_results(reply) == [(True, False)]
    assert _stream(events, job_id) == ["token", "done"]
    assert not events.exists(keys.job_lease(job_id)) and not conn.smembers(keys.RUNNING)
    assert record(conn, job_id).status == "finished"
    assert conn.hget(keys.METRIC_JOBS, "finished") == b"1"


def test_an_end_whose_record_write_never_came_is_finished_from_the_stream_once(conn, events):
    job_id = _claim(conn, events)
    # the worker dies between its two round trips: the events landed, the record never heard
    assert cluster_step.append_events(events, [_final(job_id)]) == [True]
    assert record(conn, job_id).status == "queued" and conn.sismember(keys.RUNNING, job_id)
    assert cluster_step.finish_from_stream(events, conn, job_id) == "finished"
    assert cluster_step.finish_from_stream(events, conn, job_id) == "finished"  # a 2nd reaper
    finished = record(conn, job_id)
    assert finished.status == "finished" and finished.result["id"] == "cmpl"
    assert not conn.smembers(keys.RUNNING)
    assert conn.hget(keys.METRIC_JOBS, "finished") == b"1"


def test_a_stream_without_its_end_is_not_finished_by_recovery(conn, events):
    job_id = _claim(conn, events)
    entry = scripts.step_entry(job_id, "w:1", scripts.STEP_WRITE, 0, [TOKEN])
    assert cluster_step.append_events(events, [entry]) == [True]
    assert cluster_step.finish_from_stream(events, conn, job_id) is None
    assert conn.sismember(keys.RUNNING, job_id)


def test_the_scripts_are_loaded_again_on_nodes_that_lost_them(conn, events):
    job_id = _claim(conn, events)
    events.script_flush()  # every primary, as after restarts or failovers
    conn.script_flush()
    entry = scripts.step_entry(job_id, "w:1", scripts.STEP_WRITE, 0, [TOKEN])
    reply = cluster_step.write_step(events, conn, [entry])
    assert scripts.step_results(reply) == [(True, False)]
    assert _stream(events, job_id) == ["token"]
