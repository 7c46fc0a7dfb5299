"""The stream readers of an API process when the job streams live on a Redis Cluster
(`LLMQ_EVENTS_CLUSTER`): which reader reads which stream, and where its XREAD goes.

A command's keys must share a hash slot there, so each reader reads one event bucket's
streams (`keys.event_bucket`; at most `keys.EVENT_BUCKETS` readers), its own wake stream in
the same slot (`keys.api_wake_in`), and its XREAD goes straight to the node of that slot.
api/app.py builds `BucketReaders` for a cluster once, when the app starts; api/streams/stream_hub.py
asks it for a job's reader and never asks which broker it reads.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException

from api.streams.xread_replies import XRead, xread_args
from workers import keys

Reader = TypeVar("Reader")


class BucketReaders:
    """One reader per event bucket with followed streams, made when the bucket's first
    follower comes (`StreamHub`'s reader placement on an events cluster)."""

    def __init__(self, cluster: RedisCluster) -> None:
        self.events = cluster
        self.xread = routed_xread(cluster)
        self._buckets: dict[int, Any] = {}

    def reader_for(self, job_id: str, new: Callable[[str], Reader]) -> Reader:
        """The reader of `job_id`'s bucket; `new(wake_key)` makes it the first time."""
        bucket = keys.event_bucket(job_id)
        reader = self._buckets.get(bucket)
        if reader is None:
            reader = self._buckets[bucket] = new(keys.api_wake_in(bucket, uuid.uuid4().hex))
        return reader

    def cluster_connections(self) -> int:
        """Connections open to the cluster's nodes: the blocking readers' and the requests'."""
        nodes = [n for n in self.events.get_nodes() if n.redis_connection is not None]
        pools = [node.redis_connection.connection_pool for node in nodes]
        return sum(getattr(pool, "_created_connections", 0) for pool in pools)


def routed_xread(cluster: RedisCluster) -> XRead:
    """XREAD on an events cluster, sent to the node that holds the call's keys (all in its
    bucket's slot, the reader's wake stream too). redis-py cannot parse XREAD's keys itself
    (they move with its options) and asks a server, `COMMAND GETKEYS`, twice a call: two
    round trips more per read, all to one node, which made it the cluster's busiest
    (bench/fleet.py). A slot that moved is still followed (redis-py's MOVED handling); one
    its table does not cover (a failover under way) is read as redis-py routes it, with its
    retries and a fresh table."""

    def xread(streams: dict[str, str], count: int, block: int) -> Any:
        try:
            slot = cluster.keyslot(next(iter(streams)))
            node = cluster.nodes_manager.get_node_from_slot(slot)
        except RedisClusterException:
            return cluster.xread(streams, count=count, block=block)
        return cluster.execute_command(*xread_args(streams, count, block), target_nodes=node)

    return xread
