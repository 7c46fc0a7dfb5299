"""Benchmark webhook delivery: outbox -> dispatcher -> RQ -> signed POST -> receiver.

    python bench/webhooks.py [--latency 200] [--burst 10000] [--down 30] [--processes 1]

It starts its own broker (a real redis-server on a free port: the one on PATH, else the one
installed with llmq; `--redis-url` names another), `--processes` `llmq webhooks` processes,
and a local receiver (a threaded HTTP server on 127.0.0.1, allowed by LLMQ_WEBHOOK_ALLOW)
that checks every signature and counts deliveries by `webhook-id`. Jobs are not generated:
each event is the terminal write of a job record marked as notifying (`wire.events.
write_ending`, which appends the outbox entry in the same MULTI), as a worker's end writes it.

1. Latency, one event at a time: from the terminal write (the outbox entry, taken as the
   time just before its MULTI is sent) to the receiver's 2xx (the time the receiver
   answers); p50, p90, p99, max.
2. Burst: `--burst` terminal writes at once (pipelines of 500), the receiver taken down
   (connections refused) for `--down` seconds once half of them have arrived, then back up;
   the run ends when every event has arrived. Reports none lost (distinct ids = events),
   none twice (POSTs per id), total time, and the retry schedule it ran under (the default,
   1, 2, 4 ... s).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import redis

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.broker import add_broker_args, broker_from_args  # noqa: E402
from bench.harness import header, log, meta, stop_cleanly_on_sigterm  # noqa: E402
from workers import keys  # noqa: E402
from workers.supervisor import free_port  # noqa: E402
from workers.wire import webhooks as wire  # noqa: E402
from workers.wire.events import write_ending  # noqa: E402
from workers.wire.job import CANCELLED, COMPLETIONS, JobRecord  # noqa: E402

PIPELINE = 500


class CountingReceiver:
    """A webhook receiver on a fixed loopback port that can go down (connections refused)
    and come back; counts POSTs by `webhook-id` and verifies each signature."""

    def __init__(self, secret: str = "", port: int = 0) -> None:
        self.secret = secret
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}/hook"
        self.lock = threading.Condition()
        self.counts: dict[str, int] = {}
        self.first_at: dict[str, float] = {}
        self.bad_signatures = 0
        self.server: ThreadingHTTPServer | None = None

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self
        from standardwebhooks.webhooks import Webhook, WebhookVerificationError

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                headers = {k.lower(): v for k, v in self.headers.items()}
                ok = True
                if receiver.secret:
                    try:
                        Webhook(receiver.secret).verify(body, headers)
                    except WebhookVerificationError:
                        ok = False
                self.send_response(204 if ok else 400)
                self.send_header("Content-Length", "0")
                self.end_headers()
                at = time.time()
                with receiver.lock:
                    if not ok:
                        receiver.bad_signatures += 1
                    else:
                        event_id = headers.get("webhook-id", "")
                        receiver.counts[event_id] = receiver.counts.get(event_id, 0) + 1
                        receiver.first_at.setdefault(event_id, at)
                    receiver.lock.notify_all()

            def log_message(self, *args: Any) -> None:
                pass

        return Handler

    def up(self) -> None:
        ThreadingHTTPServer.allow_reuse_address = True
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler())
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def down(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def distinct(self) -> int:
        with self.lock:
            return len(self.counts)

    def wait(self, predicate: Any, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self.lock:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.lock.wait(min(left, 0.5))
        return True


def start_webhooks(url: str, n: int, env: dict[str, str]) -> list[subprocess.Popen[bytes]]:
    """`n` `llmq webhooks` processes, each in its own session (a kill reaches its scheduler)."""
    procs = []
    for _ in range(n):
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "llmq", "webhooks", "--log-level", "WARNING"],
                cwd=REPO,
                env={**os.environ, **env, "REDIS_URL": url},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        )
    return procs


def stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    import signal

    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def notifying_jobs(conn: redis.Redis, n: int) -> list[str]:
    """`n` job records as the API stores a response's (marked as notifying)."""
    ids = [f"resp_{uuid.uuid4().hex}" for _ in range(n)]
    for start in range(0, n, PIPELINE):
        with conn.pipeline(transaction=False) as pipe:
            for job_id in ids[start : start + PIPELINE]:
                record = JobRecord(id=job_id, endpoint=COMPLETIONS, model="m", request={})
                pipe.hset(keys.job(job_id), mapping={**record.to_hash(), **wire.notify_fields()})
            pipe.execute()
    return ids


def end_jobs(conn: redis.Redis, ids: Sequence[str]) -> None:
    body = {"error": {"message": "cancelled", "code": "cancelled"}, "status": 499}
    for start in range(0, len(ids), PIPELINE):
        with conn.pipeline() as pipe:
            for job_id in ids[start : start + PIPELINE]:
                write_ending(pipe, job_id, CANCELLED, body)
            pipe.execute()


def expected_id(job_id: str) -> str:
    return wire.event_id("response.cancelled", job_id)


def measure_latency(conn: redis.Redis, receiver: CountingReceiver, n: int) -> list[float]:
    ms = []
    for job_id in notifying_jobs(conn, n):
        event_id = expected_id(job_id)
        written = time.time()
        end_jobs(conn, [job_id])
        if not receiver.wait(lambda event_id=event_id: event_id in receiver.counts, 30):
            raise SystemExit(f"event {event_id} never arrived")
        ms.append((receiver.first_at[event_id] - written) * 1000)
    return ms


def measure_burst(
    conn: redis.Redis, receiver: CountingReceiver, n: int, down_s: float
) -> dict[str, Any]:
    ids = notifying_jobs(conn, n)
    wanted = {expected_id(j) for j in ids}
    before = receiver.distinct()
    started = time.time()
    end_jobs(conn, ids)
    written_s = time.time() - started
    receiver.wait(lambda: len(receiver.counts) - before >= n // 2, 600)
    receiver.down()
    went_down = time.time() - started
    time.sleep(down_s)
    receiver.up()
    log(f"  receiver down {went_down:.1f}-{time.time() - started:.1f} s into the burst")
    arrived = receiver.wait(lambda: wanted <= receiver.counts.keys(), 3600)
    total = time.time() - started
    time.sleep(2)  # anything arriving twice late
    with receiver.lock:
        seen = {i: receiver.counts.get(i, 0) for i in wanted}
    return {
        "events": n,
        "written_s": written_s,
        "down_at_s": went_down,
        "down_s": down_s,
        "total_s": total,
        "all_arrived": arrived,
        "lost": sum(1 for c in seen.values() if c == 0),
        "twice": sum(1 for c in seen.values() if c > 1),
        "posts": sum(seen.values()),
        "bad_signatures": receiver.bad_signatures,
        "dead": len(FailedRegistry(conn)),
    }


def FailedRegistry(conn: redis.Redis) -> list[str]:  # noqa: N802 - reads as the registry
    from rq.registry import FailedJobRegistry

    from workers.wire.webhook_jobs import webhook_queue

    return FailedJobRegistry(queue=webhook_queue(conn)).get_job_ids()


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--latency", type=int, default=200, help="events sent one at a time")
    p.add_argument("--burst", type=int, default=10_000, help="events sent at once")
    p.add_argument("--down", type=float, default=30.0, help="seconds the receiver is down")
    p.add_argument("--processes", type=int, default=1, help="`llmq webhooks` processes")
    add_broker_args(p)
    args = p.parse_args(argv)
    stop_cleanly_on_sigterm()
    broker = broker_from_args(p, args)
    running = broker.start(free_port())
    conn = redis.Redis.from_url(running.url)
    receiver = CountingReceiver()
    receiver.up()
    endpoint = wire.create_endpoint(conn, receiver.url, ["response.cancelled"])
    receiver.secret = endpoint.secret
    env = {"LLMQ_WEBHOOK_ALLOW": "127.0.0.1"}
    procs = start_webhooks(running.url, args.processes, env)
    try:
        time.sleep(1.0)
        log(f"latency: {args.latency} events one at a time")
        measure_latency(conn, receiver, 5)  # warm: connections, imports
        latency = measure_latency(conn, receiver, args.latency)
        log(f"burst: {args.burst} events, receiver down {args.down:.0f} s in the middle")
        burst = measure_burst(conn, receiver, args.burst, args.down)
    finally:
        stop(procs)
        receiver.down()
        running.stop()
    info = meta(sys.argv)
    lines = header("bench/webhooks.py", info)
    lines.append(
        f"broker: {broker.describe()} | {args.processes} `llmq webhooks` process(es) | receiver: "
        "threaded http.server on 127.0.0.1, every signature verified"
    )
    lines.append("")
    lines.append(
        "| latency, terminal write -> receiver 2xx | events | p50 ms | p90 ms | p99 ms | max ms |"
    )
    lines.append("| --- | ---: | ---: | ---: | ---: | ---: |")
    lines.append(
        f"| one at a time | {len(latency)} | {statistics.median(latency):.1f} | "
        f"{percentile(latency, 0.9):.1f} | {percentile(latency, 0.99):.1f} | {max(latency):.1f} |"
    )
    lines.append("")
    lines.append(
        "| burst | events | receiver down | total s | lost | twice | POSTs | bad signature | dead |"
    )
    lines.append("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    b = burst
    lines.append(
        f"| written in {b['written_s']:.1f} s | {b['events']} | {b['down_s']:.0f} s from "
        f"{b['down_at_s']:.1f} s | {b['total_s']:.1f} | {b['lost']} | {b['twice']} | "
        f"{b['posts']} | {b['bad_signatures']} | {b['dead']} |"
    )
    print("\n".join(lines))
    ok = b["all_arrived"] and b["lost"] == 0 and b["twice"] == 0 and not b["bad_signatures"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
