"""Taking over what a dead `llmq webhooks` process left in flight, in seconds, from any host.

Left to RQ (docs/faults.md L1, F24), a delivery whose process was killed waits: one it had
started until its StartedJobRegistry entry expires (the job's timeout + 60 s); one it had
dequeued (BLMOVE into the queue's intermediate list) but not yet started until a maintenance
pass has seen it there for a minute, and an idle worker blocked on its queue runs that pass
only every 405 s; retries due meanwhile until the dead scheduler's lock expires (61 s). A
check of the dead process's pid works only on its own host.

So, as workers/leases.py and workers/recovery.py do for jobs, each process holds a lease
with a short TTL, `keys.webhook_alive(name)`, renewed by a thread (`Presence`), and every
process's dispatcher thread sweeps each `REAP_SECONDS` (`Reaper.sweep`), taking over:

- outbox entries pending for a dispatcher whose lease is gone: claimed (XCLAIM) for this
  process's dispatcher, which enqueues them again (the delivery's id makes that idempotent);
- deliveries whose run (RQ's StartedJobRegistry entry and execution, which name the worker)
  belongs to a worker whose lease is gone: the run cleared, the job back at the front of the
  queue now; a run that had begun its POST counts as a failed attempt (a dead letter if it
  was the last);
- deliveries dequeued and not yet registered as a run (RQ's BLMOVE into the queue's
  intermediate list, then a kill before the next MULTI): no worker is recorded for them, so
  one every sweep has seen there without a run for `LEASE_SECONDS` goes back to the front of
  the queue (a live worker holds one there for a few round trips; one stalled longer runs
  it too: a duplicate, not a loss); the script's LREM is the claim among reapers;
- the webhook queue's scheduler lock, when its holder's heartbeat (RQ's scheduler writes
  it every second) has not moved for `LEASE_SECONDS`: dropped, so `keep_scheduler` takes it.

A delivery in flight at a death is thus back on the queue within `LEASE_SECONDS` +
`REAP_SECONDS` (12 s) of it while any `llmq webhooks` process runs, whatever its host, or
that long after one starts. Every takeover is at least once: the dead run's POST may have
reached its receiver, which dedupes by `webhook-id`; a live process mistaken for dead
(stalled past its lease) costs a duplicate, never a loss.

The job leases themselves are not reused: `Leases.renew` renews a job's lease where its
event stream lives (an events Cluster, `workers.event_store`) and `recovery.Reaper` walks
`keys.RUNNING` and job records, which a delivery has neither of; the pattern is theirs
(a short TTL renewed by its holder, a sweep, a SET NX claim per takeover).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import redis
from rq.exceptions import NoSuchJobError
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.scheduler import SCHEDULER_KEY_TEMPLATE, RQScheduler
from rq.serializers import JSONSerializer

from workers import keys
from workers.recovery import clear_started
from workers.webhooks.delivery import attempt_number
from workers.wire.text import as_str
from workers.wire.webhook_jobs import webhook_queue
from workers.wire.webhooks import DeliveryAttempt, log_delivery

log = logging.getLogger("llmq.webhooks")

LEASE_SECONDS = 10.0  # a process's lease: gone this long after its last renewal
RENEW_SECONDS = 2.0
REAP_SECONDS = 2.0
DIED = "its webhooks process died during the attempt"

# KEYS: the intermediate list, the queue. ARGV: a job id. The LREM is the claim: of two
# reapers, one moves it.
_PUT_BACK = """
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 1 then
  redis.call('LPUSH', KEYS[2], ARGV[1])
  return 1
end
return 0
"""
_DELETE_IF = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end"


def alive(conn: redis.Redis, names: Iterable[str]) -> dict[str, bool]:
    """Whether each process named holds its lease now (one round trip)."""
    names = list(dict.fromkeys(names))
    if not names:
        return {}
    with conn.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.exists(keys.webhook_alive(name))
        return {name: bool(n) for name, n in zip(names, pipe.execute(), strict=True)}


class Presence:
    """This process's lease: set at `start`, renewed every `renew_s` by a daemon thread
    (a delivery or a dispatch in progress never delays it), deleted at `stop` so that a
    clean exit is taken over at the next sweep."""

    def __init__(
        self,
        conn: redis.Redis,
        name: str,
        lease_s: float = LEASE_SECONDS,
        renew_s: float = RENEW_SECONDS,
    ) -> None:
        self.conn = conn
        self.name = name
        self.key = keys.webhook_alive(name)
        self.lease_ms = int(lease_s * 1000)
        self.renew_s = renew_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def renew(self) -> None:
        self.conn.set(self.key, "1", px=self.lease_ms)

    def start(self) -> None:
        """Take the lease (before anything this process reads can be claimed) and keep it."""
        self.renew()
        self._thread = threading.Thread(target=self._run, name="webhook-presence", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.renew_s):
            try:
                self.renew()
            except redis.RedisError as exc:  # the lease may lapse: a duplicate, not a loss
                log.warning("webhooks %s: lease not renewed: %s", self.name, exc)

    def stop(self) -> None:
        """Give the lease up (not waiting for the thread: a stop must not hang on Redis)."""
        self._stop.set()
        try:
            self.conn.delete(self.key)
        except redis.RedisError:  # it expires alone
            pass


@dataclass
class Swept:
    """What one sweep took over."""

    entries: int = 0  # outbox entries claimed for this process's dispatcher
    started: int = 0  # deliveries a dead worker had started
    dequeued: int = 0  # deliveries dequeued and never started
    scheduler: bool = False  # a dead scheduler's lock dropped


class Reaper:
    """One process's sweeps (their memory of what stayed unstarted is its own)."""

    def __init__(
        self,
        conn: redis.Redis,
        name: str,
        lease_s: float = LEASE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.conn = conn
        self.name = name
        self.lease_s = lease_s
        self.clock = clock
        self.queue = webhook_queue(conn)
        self._put_back = conn.register_script(_PUT_BACK)
        self._unstarted: dict[str, float] = {}  # job id -> first seen dequeued, not started
        self._scheduler: tuple[tuple[Any, Any], float] | None = None  # (holder, beat), since

    def sweep(self, consumer: str) -> Swept:
        runs = self._started()
        return Swept(
            entries=self.claim_outbox(consumer),
            started=self.take_started(runs),
            dequeued=self.take_dequeued({job_id for job_id, _ in runs}),
            scheduler=self.drop_dead_scheduler_lock(),
        )

    # ------------------------------------------------------------ the outbox

    def claim_outbox(self, consumer: str) -> int:
        """Claim for `consumer` the entries pending for dispatchers without a lease, and
        forget those dispatchers; how many entries."""
        try:
            infos = self.conn.xinfo_consumers(keys.WEBHOOK_OUTBOX, keys.WEBHOOK_OUTBOX_GROUP)
        except redis.ResponseError:  # no group yet: nothing read, nothing to claim
            return 0
        others = [as_str(i["name"]) for i in infos if as_str(i["name"]) != consumer]
        taken = 0
        for name, is_alive in alive(self.conn, others).items():
            if is_alive:
                continue
            while pending := self.conn.xpending_range(
                keys.WEBHOOK_OUTBOX, keys.WEBHOOK_OUTBOX_GROUP, "-", "+", 1000, consumername=name
            ):
                ids = [p["message_id"] for p in pending]
                self.conn.xclaim(
                    keys.WEBHOOK_OUTBOX, keys.WEBHOOK_OUTBOX_GROUP, consumer, 0, ids, justid=True
                )
                taken += len(ids)
            self.conn.xgroup_delconsumer(keys.WEBHOOK_OUTBOX, keys.WEBHOOK_OUTBOX_GROUP, name)
            log.warning("webhooks: dispatcher %s is gone; %d outbox entries taken", name, taken)
        return taken

    # ------------------------------------------------------------ started deliveries

    def _started(self) -> list[tuple[str, str]]:
        """(job id, execution id) of every run in RQ's StartedJobRegistry of the queue."""
        registry = self.queue.started_job_registry
        return list(registry.get_job_and_execution_ids(cleanup=False))

    def take_started(self, runs: list[tuple[str, str]]) -> int:
        """Put back the deliveries whose run's worker has no lease; how many.

        A run's worker is in its execution's hash (RQ writes it when the run is registered,
        before the job's own hash says `started`); the job's hash is the fallback."""
        if not runs:
            return 0
        with self.conn.pipeline(transaction=False) as pipe:
            for job_id, execution_id in runs:
                pipe.hget(Execution(execution_id, job_id, self.conn).key, "worker_name")
                pipe.hget(Job.key_for(job_id), "worker_name")
            got = pipe.execute()
        owners = [as_str(a or b or b"") for a, b in zip(got[::2], got[1::2], strict=True)]
        lives = alive(self.conn, [w for w in owners if w])
        taken = 0
        for (job_id, execution_id), owner in zip(runs, owners, strict=True):
            if owner and not lives[owner] and self._take_started(job_id, execution_id, owner):
                taken += 1
        return taken

    def _take_started(self, job_id: str, execution_id: str, owner: str) -> bool:
        claim = keys.webhook_takeover(job_id)
        if not self.conn.set(claim, self.name, nx=True, px=int(self.lease_s * 1000)):
            return False  # another reaper has it
        registry = self.queue.started_job_registry
        if self.conn.zscore(registry.key, f"{job_id}:{execution_id}") is None:
            return False  # the run ended, or was taken over, since the sweep looked
        try:
            job = Job.fetch(job_id, connection=self.conn, serializer=JSONSerializer)
        except NoSuchJobError:
            return False
        posted = job.get_status() == JobStatus.STARTED  # else killed before its POST
        if posted:  # in the delivery log before the next attempt can be
            endpoint_id, event = job.args[0], job.args[1]
            attempt, at = attempt_number(job), time.time()
            died = DeliveryAttempt(job_id, event["id"], event["type"], attempt, None, DIED, 0.0, at)
            log_delivery(self.conn, endpoint_id, died)
        with self.conn.pipeline() as pipe:  # one MULTI (enqueue_job's opens it: first)
            if not posted or job.retries_left:
                if posted:
                    job.retries_left -= 1  # the dead run was an attempt
                self.queue.enqueue_job(job, pipeline=pipe, at_front=True)
                outcome = "retrying it now"
            else:  # that was its last attempt
                job.set_status(JobStatus.FAILED, pipeline=pipe)
                self.queue.failed_job_registry.add(
                    job, ttl=job.failure_ttl, exc_string=DIED, pipeline=pipe
                )
                outcome = "dead-lettered"
            clear_started(pipe, self.conn, job)
            pipe.lrem(self.queue.intermediate_queue_key, 0, job_id)  # killed before its start
            pipe.execute()
        log.warning("delivery %s: %s died running it; %s", job_id, owner, outcome)
        return True

    # ------------------------------------------------------------ dequeued, never started

    def take_dequeued(self, running: set[str]) -> int:
        """Put back the deliveries every sweep has seen dequeued and not started (no run
        registered) for `lease_s`; how many."""
        listed = [as_str(j) for j in self.conn.lrange(self.queue.intermediate_queue_key, 0, -1)]
        now = self.clock()
        self._unstarted = {
            j: self._unstarted.get(j, now) for j in dict.fromkeys(listed) if j not in running
        }
        taken = 0
        for job_id, since in list(self._unstarted.items()):
            if now - since < self.lease_s:
                continue
            del self._unstarted[job_id]
            keys_ = [self.queue.intermediate_queue_key, self.queue.key]
            if self._put_back(keys=keys_, args=[job_id]):
                log.warning("delivery %s: dequeued by a worker that died; put back", job_id)
                taken += 1
        return taken

    # ------------------------------------------------------------ the scheduler

    def drop_dead_scheduler_lock(self) -> bool:
        """Drop the webhook queue's scheduler lock once its holder's heartbeat has stood
        still for `lease_s` of this reaper's sweeps; whether it did."""
        lock = RQScheduler.get_locking_key(keys.WEBHOOK_QUEUE)
        holder = self.conn.get(lock)
        if holder is None:
            self._scheduler = None
            return False
        beat = self.conn.hget(SCHEDULER_KEY_TEMPLATE % as_str(holder), "last_heartbeat")
        seen, now = (holder, beat), self.clock()
        if self._scheduler is None or self._scheduler[0] != seen:
            self._scheduler = (seen, now)
            return False
        if now - self._scheduler[1] < self.lease_s:
            return False
        self._scheduler = None
        if not self.conn.eval(_DELETE_IF, 1, lock, holder):
            return False
        log.warning("webhooks: scheduler %s stopped beating; its lock dropped", as_str(holder))
        return True
