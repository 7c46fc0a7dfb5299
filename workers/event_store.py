"""Where a worker's token path lives: each job's event stream and lease, and how a step, a
lease and a job's end are written there. One object per broker mode, built once when the
worker starts (`events_of`) and handed to the parts that write (`EventWriter`, `Leases`,
`Claims`, `Reaper`, `BatchDriver`), as redis-py hands out `Redis` or `RedisCluster` behind
one interface; none of them asks which mode it runs in.

- `RedisEvents`: the streams and leases on the queue Redis (one server or a Sentinel's
  master) with the records: a step is one script call (`scripts.write_step`), a lease is
  taken and given up by the same scripts that claim and requeue the job.
- `ClusterEvents`: the streams and leases on a Redis Cluster (`LLMQ_EVENTS_CLUSTER`,
  `wire.broker.EventsSettings`): a step is two round trips (`workers.cluster_step`), a lease
  is written on the cluster beside the queue Redis's scripts, and a job whose worker died
  between its stream's end and its record's is finished from its stream.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from redis.cluster import RedisCluster

from workers import cluster_step, keys, resp, scripts
from workers.wire.defaults import JOB_TTL_SECONDS
from workers.wire.events import Event, write_ending
from workers.wire.members import each_member
from workers.wire.text import as_str

Claimed = tuple[int, str, int]  # `scripts.claim`: queue index, job id, attempt or code
Ranks = Sequence[int] | None  # `scripts.claim`'s kind ranks, one a queue (None: all alike)


class Held(Protocol):
    """A job a worker runs, as its end needs it (`jobs.ActiveJob`)."""

    @property
    def id(self) -> str: ...

    lease: str
    written: int  # events of the stream's that the job has (its writes are fenced on it)


class Holder(Protocol):
    """Who takes leases, and for how long (`leases.Leases`)."""

    worker: str
    ttl_ms: int

    def name(self, attempt: int) -> str: ...


class Events:
    """What both modes offer; `queue` holds the records and queues, `client` the streams and
    leases (the same client on one Redis)."""

    queue: Any
    client: Any

    def pack(self, entries: list[cluster_step.Entry]) -> Any:
        """A step's jobs (`scripts.step_entry` each) as `write_step` sends them; built on the
        decode loop's thread, so a step sent again is sent exactly as it was."""
        raise NotImplementedError

    def write_step(self, packed: Any, metrics: Sequence[Sequence[Any]] = ()) -> Any:
        """One step's writes and the `metrics` commands: `scripts.write_step`'s reply."""
        raise NotImplementedError

    def end(self, job: Held, events: list[Event], fields: dict[str, str], used: int | None) -> bool:
        """A job's end outside a step (failed, cancelled): `events` after the ones it has
        written, and the record's `fields`, fenced by its lease; the rate-limit reservation
        settled at `used` tokens. False if the job is not this writer's any more."""
        raise NotImplementedError

    def end_unclaimed(self, job_id: str, status: str, body: dict[str, Any]) -> None:
        """The end of a job nobody holds a lease on (cancelled while queued)."""
        raise NotImplementedError

    def claim(self, queue_keys: Sequence[str], leases: Holder, ranks: Ranks) -> Claimed | None:
        """`scripts.claim` of the job first by (kind rank, priority, queue) on `queue_keys`,
        with the claimed run's lease (`leases.name(attempt)`) taken for `leases.ttl_ms`."""
        raise NotImplementedError

    def renew(self, leases: Sequence[tuple[str, str]], lease_ms: int) -> list[bool]:
        """Extend each (job id, lease) still held by `lease_ms`, in one round trip a server;
        per lease, whether it was still held."""
        raise NotImplementedError

    def requeue_fence(self, job_id: str, lease: str) -> str | None:
        """The lease `scripts.requeue` must find on the queue Redis to requeue a job held
        under `lease` ("" for none), or None when the job is not the holder's any more."""
        raise NotImplementedError

    def after_requeue(self, job_id: str, lease: str) -> None:
        """Give up `lease` once the job is back on its queue, where the requeue did not."""
        raise NotImplementedError

    def leases_of_running(self) -> Iterable[tuple[str, bool]]:
        """Every running job (`keys.RUNNING`) and whether it has a lease now."""
        raise NotImplementedError

    def finish_from_stream(self, job_id: str) -> str | None:
        """End the record of a running job whose stream already ends (its worker died
        between the two); the status it ended with, or None (then it resumes)."""
        raise NotImplementedError

    def delete_stream(self, pipe: Any, job_id: str) -> None:
        """Delete a job's stream with the queue Redis's writes `pipe` carries."""
        raise NotImplementedError

    def drop_lease(self, job_id: str) -> None:
        """Delete a job's lease, whoever holds it (a job that cannot run any more)."""
        self.client.delete(keys.job_lease(job_id))

    def close(self) -> None:
        """Close the connections that are the token path's own."""


class RedisEvents(Events):
    """The streams and leases on the queue Redis, written by the scripts that also write
    the records: a step, a claim and a requeue are one script call each."""

    def __init__(self, queue: Any) -> None:
        self.queue = self.client = queue

    def pack(self, entries: list[cluster_step.Entry]) -> tuple[list[str], list[Any]]:
        return scripts.step_call(entries)

    def write_step(self, packed: Any, metrics: Sequence[Sequence[Any]] = ()) -> Any:
        step_keys, step_args = packed
        return resp.script_round_trip(self.queue, scripts.WRITE_STEP, step_keys, step_args, metrics)

    def end(self, job: Held, events: list[Event], fields: dict[str, str], used: int | None) -> bool:
        reply = scripts.append(
            self.queue, job.id, job.lease, job.written, events, fields,
            final=True, ttl=JOB_TTL_SECONDS, used_tokens=used,
        )  # fmt: skip
        return reply is not None

    def end_unclaimed(self, job_id: str, status: str, body: dict[str, Any]) -> None:
        with self.queue.pipeline() as pipe:
            write_ending(pipe, job_id, status, body)
            pipe.execute()

    def claim(self, queue_keys: Sequence[str], leases: Holder, ranks: Ranks) -> Claimed | None:
        # the script takes the lease ("{worker}:{attempt}", `Leases.name`) with the claim
        return scripts.claim(self.queue, queue_keys, leases.worker, leases.ttl_ms, None, ranks)

    def renew(self, leases: Sequence[tuple[str, str]], lease_ms: int) -> list[bool]:
        with self.queue.pipeline(transaction=False) as pipe:
            for job_id, lease in leases:
                scripts.renew(pipe, job_id=job_id, lease=lease, lease_ms=lease_ms)
            return [bool(ok) for ok in pipe.execute()]

    def requeue_fence(self, job_id: str, lease: str) -> str:
        return lease  # the requeue script checks it and gives it up with the requeue

    def after_requeue(self, job_id: str, lease: str) -> None:
        pass

    def leases_of_running(self) -> Iterable[tuple[str, bool]]:
        return each_member(self.queue, keys.RUNNING, lambda p, j: p.exists(keys.job_lease(j)))

    def finish_from_stream(self, job_id: str) -> None:
        return None  # a job's stream and record end in one script: never one without the other

    def delete_stream(self, pipe: Any, job_id: str) -> None:
        pipe.delete(keys.job_events(job_id))


class ClusterEvents(Events):
    """The streams and leases on a Redis Cluster, one hash slot a job
    (`keys.job_events`, `keys.job_lease`), the rest on the queue Redis: no script spans
    the two, so each write goes to the cluster first, then to the queue Redis
    (`workers.cluster_step`)."""

    def __init__(self, queue: Any, cluster: RedisCluster) -> None:
        self.queue, self.client = queue, cluster

    def pack(self, entries: list[cluster_step.Entry]) -> list[cluster_step.Entry]:
        return entries

    def write_step(self, packed: Any, metrics: Sequence[Sequence[Any]] = ()) -> Any:
        return cluster_step.write_step(self.client, self.queue, packed, metrics)

    def end(self, job: Held, events: list[Event], fields: dict[str, str], used: int | None) -> bool:
        entry = scripts.step_entry(
            job.id, job.lease, scripts.STEP_FINAL, job.written, events, fields, used, False
        )
        reply = cluster_step.write_step(self.client, self.queue, [entry])
        return scripts.step_results(reply)[0][0]

    def end_unclaimed(self, job_id: str, status: str, body: dict[str, Any]) -> None:
        cluster_step.end_unclaimed(self.client, self.queue, job_id, status, body)

    def claim(self, queue_keys: Sequence[str], leases: Holder, ranks: Ranks) -> Claimed | None:
        claimed = scripts.claim(self.queue, queue_keys, leases.worker, 0, None, ranks)
        if claimed is not None and claimed[2] >= 1:
            # after the claim: a worker that dies between the two leaves a running job
            # without a lease, which the reaper requeues. A claimed attempt is the newest
            # (attempts only grow), so its lease replaces any (a reaper's lock)
            lease = leases.name(claimed[2])
            self.client.set(keys.job_lease(claimed[1]), lease, px=leases.ttl_ms)
        return claimed

    def renew(self, leases: Sequence[tuple[str, str]], lease_ms: int) -> list[bool]:
        calls = [([keys.job_lease(job_id)], [lease, lease_ms]) for job_id, lease in leases]
        return [bool(ok) for ok in cluster_step.per_node(self.client, scripts.RENEW, calls)]

    def requeue_fence(self, job_id: str, lease: str) -> str | None:
        # checked here first; the job is then put back only if it is still running, and the
        # lease given up after (`after_requeue`): one that dies between finds the lease
        # expiring, and the next sweep requeues the job once (it left the running set)
        held = self.client.get(keys.job_lease(job_id))
        return "" if held is not None and as_str(held) == lease else None

    def after_requeue(self, job_id: str, lease: str) -> None:
        scripts.give_up(self.client, job_id, lease)

    def leases_of_running(self) -> Iterable[tuple[str, bool]]:
        running = [as_str(m) for m in self.queue.smembers(keys.RUNNING)]
        if not running:
            return []
        with self.client.pipeline(transaction=False) as pipe:
            for job_id in running:
                pipe.exists(keys.job_lease(job_id))
            return list(zip(running, pipe.execute(), strict=True))

    def finish_from_stream(self, job_id: str) -> str | None:
        return cluster_step.finish_from_stream(self.client, self.queue, job_id)

    def delete_stream(self, pipe: Any, job_id: str) -> None:
        # a command a key on the cluster, now: a MULTI cannot carry it
        self.client.delete(keys.job_events(job_id))

    def close(self) -> None:
        self.client.close()


def events_of(queue: Any, client: Any = None) -> Events:
    """The token path's object for a process whose records are on `queue`, built where it
    starts (`LLMQWorker`, a test's fixture) and handed to every part that needs one: the
    streams and leases on `client` (`queue` when None). The one place a client's kind decides
    the mode (`EventsSettings.connect` gives a `RedisCluster` for `LLMQ_EVENTS_CLUSTER`, else
    `queue` itself)."""
    client = queue if client is None else client
    if isinstance(client, RedisCluster):
        return ClusterEvents(queue, client)
    return RedisEvents(client)
