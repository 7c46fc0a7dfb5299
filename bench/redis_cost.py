"""What a worker's token writes cost Redis: per command and per token, through the real writer.

    python bench/redis_cost.py [--redis-url redis://127.0.0.1:6379/15] [--jobs 64] [--steps 40]
                               [--events-cluster host:port,...]

`--jobs` jobs are claimed through the worker's own claim script (`workers.claims`, a real
lease each), then `--steps` decode steps are written as the worker writes them: every job
gets one token event a step and `EventWriter.flush` sends the step, the last step carries
each job's result (its final, fenced write). Around the writes: CONFIG RESETSTAT, then INFO
commandstats (calls and usec_per_call of each command Redis ran; a script's commands are
listed too, and also counted in the script's own time) and the delta of Redis's
`used_cpu_sys` + `used_cpu_user` (everything Redis spent, reading and replying included: the
figure to compare). Printed per token written, with the writer's wall time per step (one
round trip, waited for: `flush`).

It measures the writer only (no engine, no reader); `bench/fleet.py` adds the API's relay.
The db given is flushed before and after: give it one of its own. With `--events-cluster`
(`LLMQ_EVENTS_CLUSTER`'s startup nodes; the cluster is flushed too) the streams and leases
are written there (`workers/cluster_step.py`): the commands and CPU of the cluster's
primaries and of the queue Redis are printed apart.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import redis  # noqa: E402

from bench import token_path  # noqa: E402
from bench.harness import cpu_name  # noqa: E402
from bench.token_path import SimJob, result_body  # noqa: E402
from workers import keys  # noqa: E402
from workers.claims import Claims  # noqa: E402
from workers.event_store import Events, events_of  # noqa: E402
from workers.event_writer import EventWriter  # noqa: E402
from workers.leases import Leases  # noqa: E402
from workers.wire.broker import EVENTS_CLUSTER_ENV, EventsSettings, redact  # noqa: E402
from workers.wire.events import token_event  # noqa: E402
from workers.wire.job import COMPLETIONS, JobRecord  # noqa: E402

MODEL = "sim-model"
# Redis 7 counts a script's commands under their own names too, and inside the script's time
SCRIPT_COMMANDS = ("eval", "evalsha", "fcall")
WORKER = "sim-worker"


def claim_jobs(conn: redis.Redis, count: int, events: Events, worker: str = WORKER) -> list[SimJob]:
    """`count` job records as the API stores them, claimed with the worker's claim script
    (from a private list: no RQ queue is needed to hold a lease)."""
    leases = Leases(events, worker, ttl_seconds=600)
    hand = f"{keys.PREFIX}:bench:hand:{worker}"
    jobs = []
    for _ in range(count):
        record = JobRecord(
            id=uuid.uuid4().hex, endpoint=COMPLETIONS, model=MODEL, request={"prompt": "x"}
        )
        conn.hset(keys.job(record.id), mapping=record.to_hash())
        conn.rpush(hand, record.id)
        claim = Claims(conn, leases, events).take([hand])
        assert claim is not None and claim.attempt == 1, claim
        jobs.append(SimJob(record, claim.attempt, leases.name(claim.attempt), None, None))
    return jobs


def add_token(job: SimJob, final: bool) -> None:
    """One generated token (as a worker's step appends it), and the result on the last."""
    index = job.tokens
    text = f" tok{index}"
    finish = "length" if final else None
    job.pending.append(token_event(0, index, text, 1000 + index, None, finish, job.attempt))
    job.tokens += 1
    if final:
        job.result = result_body(job, "".join(f" tok{i}" for i in range(job.tokens)))


def primaries(events: Any) -> list[redis.Redis]:
    """A client of each primary of the events cluster."""
    return [events.get_redis_connection(node) for node in events.get_primaries()]


def run(conn: redis.Redis, jobs: int, steps: int, cluster: Any = None) -> dict[str, Any]:
    """`cluster`: the events cluster's client, or None for the streams on `conn`."""
    events = events_of(conn, cluster)  # the token path's mode, chosen once here
    sim = claim_jobs(conn, jobs, events)
    writer = EventWriter(conn, WORKER, own_models=set(), events=events)
    nodes = primaries(cluster) if cluster is not None else []
    for node in [conn, *nodes]:
        node.config_resetstat()
    cpu0 = token_path.redis_cpu(conn)
    cluster0 = sum(token_path.redis_cpu(node) for node in nodes)
    walls = []
    for step in range(steps):
        for job in sim:
            add_token(job, final=step == steps - 1)
        started = time.perf_counter()
        flushed = writer.flush(sim, {MODEL: len(sim)})
        walls.append(time.perf_counter() - started)
        assert not flushed.lost, "a lease was lost"
    cpu = token_path.redis_cpu(conn) - cpu0
    stats = token_path.command_stats(conn)
    if nodes:
        cluster_cpu = sum(token_path.redis_cpu(node) for node in nodes) - cluster0
        for node in nodes:
            token_path.add_cluster_stats(stats, node)
        print(
            f"cluster primaries ({len(nodes)}): used_cpu us per token written "
            f"{cluster_cpu * 1e6 / (jobs * steps):.2f}; queue Redis below"
        )
    close = getattr(writer, "close", None)
    if close is not None:
        close()
    return {"tokens": jobs * steps, "cpu_s": cpu, "stats": stats, "walls": walls}


def report(result: dict[str, Any]) -> None:
    tokens = result["tokens"]
    stats = result["stats"]
    print(f"{'command':22} {'calls':>8} {'us/call':>9} {'us/token':>9}")
    scripts = 0.0
    for name, s in sorted(stats.items(), key=lambda kv: -float(kv[1]["usec"])):
        if name.startswith(("config", "info")):
            continue  # the bench's own
        if name.removeprefix("cluster:") in SCRIPT_COMMANDS:
            scripts += float(s["usec"])
        per_call = float(s["usec_per_call"])
        print(f"{name:22} {int(s['calls']):8d} {per_call:9.2f} {float(s['usec']) / tokens:9.2f}")
    walls = sorted(result["walls"])
    print(f"script calls us per token written (their commands included): {scripts / tokens:.2f}")
    print(f"used_cpu (sys+user) us per token written: {result['cpu_s'] * 1e6 / tokens:.2f}")
    print(
        f"writer wall per step: median {walls[len(walls) // 2] * 1e3:.2f} ms, "
        f"max {walls[-1] * 1e3:.2f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/15")
    parser.add_argument("--jobs", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--events-cluster", help="startup nodes: the events on a cluster")
    args = parser.parse_args()
    conn = redis.Redis.from_url(args.redis_url)
    events = None
    if args.events_cluster:
        settings = EventsSettings.from_env({EVENTS_CLUSTER_ENV: args.events_cluster})
        events = settings.connect(conn)
        for node in primaries(events):
            node.flushall()
    version = conn.info("server")["redis_version"]
    print(
        f"redis_cost: {args.jobs} jobs x {args.steps} steps through workers.event_writer "
        f"({REPO}); broker: Redis {version} at {redact(args.redis_url)} (--redis-url); "
        f"{cpu_name()}, "
        f"{os.cpu_count()} CPUs (shared with other work: figures are indicative)"
    )
    conn.flushdb()
    try:
        report(run(conn, args.jobs, args.steps, events))
    finally:
        conn.flushdb()


if __name__ == "__main__":
    main()
