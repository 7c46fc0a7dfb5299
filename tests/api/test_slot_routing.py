"""api/streams/slot_routing.py: on an events cluster each event bucket has its own stream reader,
whose wake stream shares the bucket's slot and whose XREAD goes straight to that slot's node.
The unit tests need no cluster; the routed reads run on a real local one."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from redis.crc import key_slot
from redis.exceptions import SlotNotCoveredError

from api.streams.slot_routing import BucketReaders, routed_xread
from api.streams.stream_hub import StreamHub
from tests.events_cluster import flush, local_cluster
from workers import keys
from workers.wire.broker import EventsSettings
from workers.wire.events import ending, event_fields, token_event
from workers.wire.job import FINISHED


def _slot(key: str) -> int:
    return key_slot(key.encode())


def test_jobs_of_one_bucket_share_a_reader_whose_wake_stream_is_in_their_slot() -> None:
    placement = BucketReaders(object())  # type: ignore[arg-type]  # no read is made
    made: list[str] = []

    def new(wake_key: str) -> str:
        made.append(wake_key)
        return wake_key  # the reader, as far as the placement can tell

    jobs = [uuid.uuid4().hex for _ in range(4 * keys.EVENT_BUCKETS)]
    readers = {job_id: placement.reader_for(job_id, new) for job_id in jobs}
    assert len(made) == len({keys.event_bucket(job_id) for job_id in jobs})
    for job_id, wake_key in readers.items():
        assert _slot(wake_key) == _slot(keys.job_events(job_id)) == _slot(keys.job_lease(job_id))
    assert placement.reader_for(jobs[0], new) == readers[jobs[0]]  # no second reader
    assert len(made) == len(set(made))


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EventsSettings]:
    with local_cluster(tmp_path_factory.mktemp("cluster")) as ports:
        yield EventsSettings(((("127.0.0.1", ports[0])),))
        flush(ports)


@pytest.mark.integration
def test_the_stream_readers_send_each_read_to_its_node_without_asking_for_its_keys(
    real_redis, settings: EventsSettings
) -> None:
    """api/streams/slot_routing.py: every bucket's XREAD goes straight to the node of its slot;
    redis-py alone asks a server for XREAD's keys (COMMAND GETKEYS) twice a read."""
    cluster = settings.connect(real_redis)
    nodes = cluster.get_primaries()
    for node in nodes:
        cluster.config_resetstat(target_nodes=node)
    hub = StreamHub(real_redis, placement=BucketReaders(cluster))
    jobs = [f"routed-{i}" for i in range(3 * keys.EVENT_BUCKETS)]  # every bucket, every node
    followers = [hub.follow(job_id) for job_id in jobs]
    for job_id in jobs:
        fields = event_fields(token_event(0, 0, "t ", 0, None, None, 1))
        cluster.xadd(keys.job_events(job_id), fields)
        _, done = ending(FINISHED, {"id": job_id, "choices": []})  # the stream's end alone
        cluster.xadd(keys.job_events(job_id), event_fields(done))
    for follower in followers:
        got = []
        while not got or not got[-1].terminal:
            got.extend(follower.take(10) or pytest.fail(f"{follower.job_id}: no events"))
        assert [event.kind for event in got] == ["token", "done"]
        hub.leave(follower)
    for node in nodes:
        stats = cluster.info("commandstats", target_nodes=node)
        assert stats.get("cmdstat_xread", {}).get("calls", 0) > 0, node.name
        assert "cmdstat_command|getkeys" not in stats, (node.name, stats)
    cluster.close()


@pytest.mark.integration
def test_a_slot_missing_from_the_table_is_read_as_redis_py_routes_it(
    real_redis, settings: EventsSettings, monkeypatch
) -> None:
    """A failover under way: the reader's own lookup of the slot's node fails, and the call
    goes through redis-py's routing (its retries, a fresh slot table) instead of failing."""
    cluster = settings.connect(real_redis)
    key = keys.job_events("uncovered")
    entry = cluster.xadd(key, event_fields(token_event(0, 0, "t ", 0, None, None, 1)))

    def uncovered(*_args, **_kwargs):
        raise SlotNotCoveredError("slot not covered")

    monkeypatch.setattr(cluster.nodes_manager, "get_node_from_slot", uncovered)
    monkeypatch.setattr(cluster, "xread", lambda *a, **kw: ("routed", a, kw))
    assert routed_xread(cluster)({key: "0"}, 5, 10) == (
        "routed",
        ({key: "0"},),
        {"count": 5, "block": 10},
    )
    monkeypatch.undo()
    [[read_key, entries]] = routed_xread(cluster)({key: "0"}, 5, 10)
    assert read_key == key.encode() and entries[0][0] == entry
    cluster.close()
