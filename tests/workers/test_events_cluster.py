"""The token path on a real local Redis Cluster (`LLMQ_EVENTS_CLUSTER`): each job's stream and
lease on the cluster in one hash slot, its record, the running set and the metrics on the
queue Redis (`workers.cluster_step`), and a job's end exactly once across the two."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot

from tests.events_cluster import flush, local_cluster
from tests.workers.conftest import TINY, record, submit, wait_done, wait_for
from workers import cluster_step, keys, scripts
from workers.event_store import ClusterEvents, events_of
from workers.event_writer import EventWriter
from workers.jobs import ActiveJob
from workers.leases import Leases
from workers.recovery import Reaper
from workers.wire.broker import BrokerConfigError, EventsSettings
from workers.wire.errors import cancelled_error
from workers.wire.events import decode_event
from workers.wire.job import JobRecord

pytestmark = pytest.mark.integration

COMPLETIONS = "/v1/completions"
QUEUES = [f"rq:queue:{keys.queue_name('tiny-llama')}"]
TOKEN = ("token", '{"index": 0}')


@pytest.fixture(scope="module")
def cluster_ports(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[int]]:
    with local_cluster(tmp_path_factory.mktemp("cluster")) as ports:
        yield ports


@pytest.fixture
def settings(cluster_ports: list[int]) -> EventsSettings:
    return EventsSettings.from_env({"LLMQ_EVENTS_CLUSTER": f"127.0.0.1:{cluster_ports[0]}"})


@pytest.fixture
def events(cluster_ports: list[int], settings: EventsSettings) -> Iterator[RedisCluster]:
    flush(cluster_ports)
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
    ids = [f"job{i}" for i in range(256)]
    slots = {events.keyslot(keys.job_events(i)) for i in ids}
    nodes = {events.get_node_from_key(keys.job_events(i)).name for i in ids}
    assert len(slots) == len({keys.event_bucket(i) for i in ids}) == keys.EVENT_BUCKETS
    assert len(nodes) == 3  # jobs spread over every shard


def test_each_event_bucket_hashes_to_its_own_even_share_of_the_slots():
    share = 16384 // keys.EVENT_BUCKETS
    for bucket in range(keys.EVENT_BUCKETS):
        slot = key_slot(keys.bucket_tag(bucket).encode())
        assert bucket * share <= slot < (bucket + 1) * share


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


GREEDY = {"model": TINY, "temperature": 0, "ignore_eos": True}


def _tokens(events: RedisCluster, job_id: str) -> int:
    return _stream(events, job_id).count("token")


def test_a_worker_streams_every_token_onto_the_cluster_and_ends_the_job_once(
    conn, events, settings, start_worker
):
    jobs = [
        submit(conn, COMPLETIONS, {**GREEDY, "prompt": f"p{i}", "max_tokens": 8}) for i in "abc"
    ]
    start_worker(events=settings)
    for job_id in jobs:
        done = wait_done(conn, job_id)
        assert done.status == "finished" and done.result["usage"]["completion_tokens"] == 8
        assert _stream(events, job_id) == ["token"] * 8 + ["done"]
        assert not conn.exists(keys.job_events(job_id))  # nothing of it on the queue Redis
        assert not events.exists(keys.job_lease(job_id))
    assert conn.hget(keys.METRIC_JOBS, "finished") == b"3" and not conn.smembers(keys.RUNNING)


def test_cancel_and_a_lost_lease_act_on_a_job_whose_stream_is_on_the_cluster(
    conn, events, settings, start_worker
):
    cancelled = submit(conn, COMPLETIONS, {**GREEDY, "prompt": "go", "max_tokens": 200})
    fenced = submit(conn, COMPLETIONS, {**GREEDY, "prompt": "fence", "max_tokens": 200})
    worker = start_worker(events=settings, step_delay=0.02)
    wait_for(lambda: _tokens(events, cancelled) >= 3 and _tokens(events, fenced) >= 3)
    conn.set(keys.job_cancel(cancelled), "1")  # the API's cancel: on the queue Redis
    events.set(keys.job_lease(fenced), "someone-else:9")  # another worker took it over
    ended = wait_done(conn, cancelled)
    assert ended.status == "cancelled" and ended.error == cancelled_error()
    assert _stream(events, cancelled)[-1] == "error"
    wait_for(lambda: not worker.running.jobs, what="the fenced job to be dropped")
    frozen = len(_stream(events, fenced))
    assert "done" not in _stream(events, fenced) and record(conn, fenced).status == "started"
    time.sleep(0.2)
    assert len(_stream(events, fenced)) == frozen


def test_the_reaper_resumes_a_vanished_workers_job_or_finishes_one_that_had_ended(
    conn, events, settings, start_worker
):
    resumed = _claim(conn, events)  # claimed by "w", which dies: its lease runs out
    ended = _claim(conn, events)
    assert cluster_step.append_events(events, [_final(ended)]) == [True]  # died after this
    events.pexpire(keys.job_lease(resumed), 100)
    reaper = Reaper(conn, "reaper-test", 5_000, events_of(conn, events))
    wait_for(lambda: resumed in reaper.run(), what="the job to be requeued")
    assert record(conn, ended).status == "finished"  # from its stream, not run again
    assert conn.hget(keys.METRIC_JOBS, "finished") == b"1"
    assert not events.exists(keys.job_lease(ended))
    start_worker(events=settings)
    done = wait_done(conn, resumed)
    assert done.status == "finished" and done.attempts == 2


def test_leases_on_the_cluster_are_renewed_in_one_pipeline_and_a_stolen_one_is_reported(
    conn, events
):
    ours, stolen = _claim(conn, events), _claim(conn, events)
    events.pexpire(keys.job_lease(ours), 500)
    events.set(keys.job_lease(stolen), "other:2")
    leases = Leases(events_of(conn, events), "w", ttl_seconds=30)
    jobs = [
        ActiveJob(JobRecord(j, COMPLETIONS, TINY, {}), 1, "w:1", None, None) for j in (ours, stolen)
    ]
    assert [job.id for job in leases.renew(jobs)] == [stolen]
    assert events.pttl(keys.job_lease(ours)) > 20_000


def test_jobs_of_one_event_bucket_are_written_by_one_call_each_fenced_on_its_own(events):
    ids = [f"same{i}" for i in range(2000)]
    bucket = keys.event_bucket(ids[0])
    ours, stolen, again = [i for i in ids if keys.event_bucket(i) == bucket][:3]
    for job_id in (ours, stolen, again):
        events.set(keys.job_lease(job_id), "w:1")
    events.set(keys.job_lease(stolen), "other:2")
    assert cluster_step.append_events(
        events, [scripts.step_entry(again, "w:1", scripts.STEP_FIRST_WRITE, 0, [TOKEN])]
    ) == [True]
    entries = [
        scripts.step_entry(job_id, "w:1", scripts.STEP_WRITE, 0, [("token", '{"index": 5}')])
        for job_id in (ours, stolen, again)  # `again` expects 0 entries: it has 1
    ]
    node = events.get_redis_connection(events.get_node_from_key(keys.job_events(ours)))
    node.config_resetstat()
    assert cluster_step.append_events(events, entries) == [True, False, False]
    assert node.info("commandstats")["cmdstat_evalsha"]["calls"] == 1  # one call, 3 jobs
    assert _stream(events, ours) == ["token"] and _stream(events, stolen) == []
    assert _stream(events, again) == ["token"]


def test_a_job_cancelled_while_queued_ends_in_its_stream_on_the_cluster(
    conn, events, settings, start_worker
):
    job_id = submit(conn, COMPLETIONS, {**GREEDY, "prompt": "never", "max_tokens": 5})
    conn.set(keys.job_cancel(job_id), "1")
    start_worker(events=settings)
    ended = wait_done(conn, job_id)
    assert ended.status == "cancelled" and ended.attempts == 0
    assert _stream(events, job_id) == ["error"] and not conn.exists(keys.job_events(job_id))


def test_a_step_whose_record_write_failed_is_sent_again_and_ends_the_job_once(conn, events):
    """docs/faults.md C2: the events landed on the cluster, the queue Redis's round trip
    failed; the writer sends the step again as it was."""
    job_id = _claim(conn, events)
    record_ = record(conn, job_id)
    job = ActiveJob(record_, 1, "w:1", None, None)
    done = {"id": "cmpl", "usage": {"prompt_tokens": 2, "completion_tokens": 1}}
    job.pending.append(TOKEN)
    job.result = done
    dead = redis.Redis(port=1, socket_connect_timeout=0.2)  # the queue Redis, down
    writer = EventWriter(dead, "w", own_models=set(), events=events_of(dead, events))
    writer.send([job], None, background=True)  # as the worker's loop sends a step
    with pytest.raises(redis.ConnectionError):
        writer.collect()
    assert _stream(events, job_id) == ["token", "done"]  # write 1 landed
    assert record(conn, job_id).status == "queued"  # write 2 did not
    writer.connection = writer.events.queue = conn  # the queue Redis is back
    assert writer.flush([job], None).finished == [job]  # the kept step, sent first
    writer.close()
    assert _stream(events, job_id) == ["token", "done"]  # nothing appended twice
    assert record(conn, job_id).status == "finished" and not conn.smembers(keys.RUNNING)
    assert conn.hget(keys.METRIC_JOBS, "finished") == b"1"


def test_the_setting_names_host_port_nodes_and_unset_changes_nothing():
    assert not EventsSettings.from_env({}).clustered
    queue = redis.Redis()
    assert EventsSettings.from_env({}).connect(queue) is queue  # one Redis, one client
    nodes = EventsSettings.from_env({"LLMQ_EVENTS_CLUSTER": "10.0.0.1:7000, [::1]:7001"})
    assert nodes.nodes == (("10.0.0.1", 7000), ("::1", 7001))
    assert nodes.env() == {"LLMQ_EVENTS_CLUSTER": "10.0.0.1:7000,::1:7001"}
    with pytest.raises(BrokerConfigError, match="LLMQ_EVENTS_CLUSTER must list host:port"):
        EventsSettings.from_env({"LLMQ_EVENTS_CLUSTER": "10.0.0.1"})


def test_a_write_sent_to_a_node_that_no_longer_holds_the_slot_is_a_lost_connection(
    events, monkeypatch
):
    job_id = "moved-job"
    events.set(keys.job_lease(job_id), "w:1")
    owner = events.get_node_from_key(keys.job_events(job_id))
    [other, *_] = [n for n in events.get_primaries() if n.name != owner.name]
    monkeypatch.setattr(events, "get_node_from_key", lambda key: other)  # a stale slot map
    entry = scripts.step_entry(job_id, "w:1", scripts.STEP_WRITE, 0, [TOKEN])
    with pytest.raises(redis.ConnectionError, match="events cluster"):
        cluster_step.append_events(events, [entry])
    monkeypatch.undo()
    assert cluster_step.append_events(events, [entry]) == [True]  # sent again: lands once
    assert _stream(events, job_id) == ["token"]


def test_a_cluster_client_is_the_cluster_mode_and_its_claim_leaves_the_lease_to_the_cluster(
    conn, events
):
    store = events_of(conn, events)
    assert isinstance(store, ClusterEvents) and (store.queue, store.client) == (conn, events)
    job_id = submit(conn, COMPLETIONS, {"prompt": "hi"})
    assert store.claim(QUEUES, Leases(store, "w", 10), None) == (0, job_id, 1)
    assert not conn.exists(keys.job_lease(job_id)) and events.get(keys.job_lease(job_id)) == b"w:1"
    assert store.requeue_fence(job_id, "w:1") == ""  # checked here: the script needs none
    assert store.requeue_fence(job_id, "other:1") is None
    assert list(store.leases_of_running()) == [(job_id, 1)]
    store.drop_lease(job_id)
    assert list(store.leases_of_running()) == [(job_id, 0)]
    events.xadd(keys.job_events(job_id), dict(zip(("event", "data"), TOKEN, strict=True)))
    with conn.pipeline() as pipe:
        store.delete_stream(pipe, job_id)  # a command of its own on the cluster, at once
        assert not events.exists(keys.job_events(job_id))
        pipe.execute()
