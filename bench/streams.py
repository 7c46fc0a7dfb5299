"""How many open streams one `llmq api` holds: N streamed completions whose jobs wait in the
queue (a worker is registered, alive and serving the model, but runs nothing), opened at
`--rate` a second against `llmq api`'s gunicorn with its default settings (2 processes, the
gevent worker, LLMQ_API_REDIS_CONNECTIONS' default); only LLMQ_MAX_QUEUE is raised, so that
N jobs may wait at all.

Per N it prints: how many streams had their response headers within 1 s of sending their
request (and the p50 / p99 / max wait), the API's RSS per open stream (psutil, gunicorn's
worker processes, against their RSS before the streams), the Redis connections of each API
process (its /metrics gauge) and Redis's connected clients in all, and how long after K
clients hang up their K jobs are cancelled (docs/faults.md F4, with N streams open).

    .venv/bin/python bench/streams.py [--streams 1000,5000] [--rate 1000] [--redis-port 7201]

Clients are raw asyncio sockets in this one process (an HTTP client library per stream would
cost this machine's cores more than the API does). It starts its own real redis-server
(workers/redis_server.py: PATH's, else the one installed with llmq) on `--redis-port`, names
it in its first line, and stops everything it started.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import redis

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from api.cli import CONF  # noqa: E402
from bench.harness import cpu_name  # noqa: E402
from tests.api.fake_worker import FakeWorker  # noqa: E402
from workers import keys  # noqa: E402
from workers.redis_server import (  # noqa: E402
    RedisServerMissing,
    RedisServerProcess,
    find_redis_server,
)
from workers.supervisor import free_port  # noqa: E402

MODEL = "tiny"
HANG_UPS = 20


def raise_open_files() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def request(i: int) -> bytes:
    body = json.dumps(
        {"model": MODEL, "prompt": f"bench {i}", "max_tokens": 4, "stream": True}
    ).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class Stream:
    """One client: connects, sends its request, waits for the status line and headers."""

    def __init__(self, i: int) -> None:
        self.i = i
        self.writer: asyncio.StreamWriter | None = None
        self.status = 0
        self.wait_s: float | None = None
        self.error = ""

    async def open(self, port: int) -> None:
        sent = time.monotonic()
        try:
            reader, self.writer = await asyncio.open_connection("127.0.0.1", port)
            self.writer.write(request(self.i))
            await self.writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 120)
            self.wait_s = time.monotonic() - sent
            self.status = int(head.split(b" ", 2)[1])
        except (TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
            self.error = type(exc).__name__

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def api_processes(master: subprocess.Popen) -> list[psutil.Process]:
    return psutil.Process(master.pid).children()


def rss(processes: list[psutil.Process]) -> int:
    return sum(p.memory_info().rss for p in processes)


def gauges(port: int, name: str) -> list[float]:
    """One sample per API process that answers: scraped until both pids were seen."""
    import httpx

    seen: dict[str, float] = {}
    for _ in range(20):
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        for line in text.splitlines():
            if line.startswith(name + "{"):
                pid = line.split('pid="', 1)[1].split('"', 1)[0]
                seen[pid] = float(line.rsplit(" ", 1)[1])
        if len(seen) >= 2:
            break
    return sorted(seen.values())


def redis_cpu(conn: redis.Redis) -> float:
    cpu = conn.info("cpu")
    return float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])


def statuses(conn: redis.Redis) -> dict[str, int]:
    counts: dict[str, int] = {}
    for key in conn.scan_iter(keys.job("*"), count=5000):
        if conn.type(key) == b"hash":
            status = (conn.hget(key, "status") or b"?").decode()
            counts[status] = counts.get(status, 0) + 1
    return counts


async def run_n(n: int, rate: float, port: int, conn: redis.Redis, master) -> dict:
    procs = api_processes(master)
    base_rss = rss(procs)
    conn.config_resetstat()
    cpu_before = redis_cpu(conn)
    streams = [Stream(i) for i in range(n)]
    tasks = []
    started = time.monotonic()
    for k, stream in enumerate(streams):
        tasks.append(asyncio.create_task(stream.open(port)))
        ahead = started + (k + 1) / rate - time.monotonic()
        if ahead > 0:
            await asyncio.sleep(ahead)
    await asyncio.gather(*tasks)
    opened_s = time.monotonic() - started
    await asyncio.sleep(2.0)  # let the processes settle before measuring memory
    waits = sorted(s.wait_s for s in streams if s.wait_s is not None)
    ok = [s for s in streams if s.status == 200]
    errors: dict[str, int] = {}
    for s in streams:
        if s.status != 200:
            label = s.error or str(s.status)
            errors[label] = errors.get(label, 0) + 1
    now_rss = rss(procs)
    info = conn.info("clients")
    commands = conn.info("commandstats")
    redis_cpu_s = redis_cpu(conn) - cpu_before
    result = {
        "streams": n,
        "opened_in_s": round(opened_s, 1),
        "headers_200": len(ok),
        "within_1s": sum(1 for w in waits if w <= 1.0),
        "wait_p50_ms": round(1000 * statistics.median(waits), 1) if waits else None,
        "wait_p99_ms": round(1000 * waits[int(0.99 * (len(waits) - 1))], 1) if waits else None,
        "wait_max_ms": round(1000 * waits[-1], 1) if waits else None,
        "errors": errors,
        "api_rss_mb": round(now_rss / 2**20, 1),
        "rss_per_stream_kb": round((now_rss - base_rss) / 1024 / max(1, len(ok)), 1),
        "streams_open_gauge": gauges(port, "llmq_api_streams_open"),
        "redis_connections_per_process": gauges(port, "llmq_api_redis_connections_open"),
        "redis_connected_clients": info.get("connected_clients"),
        "jobs": statuses(conn),
        "redis_cpu_s_while_opening": round(redis_cpu_s, 2),
        "redis_calls": {
            name.removeprefix("cmdstat_"): (stat["calls"], stat["usec_per_call"])
            for name, stat in commands.items()
            if stat["calls"] >= n // 10
        },
    }
    gone = ok[:HANG_UPS]
    hung_up = time.monotonic()
    for s in gone:
        s.close()
    cancelled_s = None
    while time.monotonic() - hung_up < 60:
        if statuses(conn).get("cancelled", 0) >= len(gone):
            cancelled_s = time.monotonic() - hung_up
            break
        await asyncio.sleep(0.05)
    result["hang_ups"] = len(gone)
    result["all_cancelled_after_s"] = None if cancelled_s is None else round(cancelled_s, 2)
    for s in streams:
        s.close()
    await asyncio.sleep(3.0)  # the API notices and cancels the rest
    return result


def start_api(redis_url: str) -> tuple[subprocess.Popen, int]:
    import httpx

    port = free_port()
    env = {**os.environ, "REDIS_URL": redis_url, "LLMQ_MAX_QUEUE": "1000000"}
    env.pop("LLMQ_API_KEYS", None)
    argv = [sys.executable, "-m", "gunicorn", "-c", str(CONF), "-b", f"127.0.0.1:{port}"]
    proc = subprocess.Popen(
        [*argv, "-w", "2", "--access-logfile", "/dev/null", "api.app:create_app()"],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(200):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc, port
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("gunicorn did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="1000,5000")
    parser.add_argument("--rate", type=float, default=1000.0, help="streams opened a second")
    parser.add_argument("--redis-port", type=int, default=7201)
    args = parser.parse_args()
    limit = raise_open_files()
    try:
        binary = find_redis_server()
    except RedisServerMissing as exc:
        raise SystemExit(f"streams: {exc}") from None
    redis_server = RedisServerProcess(binary, args.redis_port, extra_args=("--maxclients", "20000"))
    url = redis_server.start()
    conn = redis.Redis.from_url(url)
    stop = threading.Event()
    api = None
    try:
        worker = FakeWorker(conn, models=(MODEL,)).register()  # alive, runs nothing

        def beat() -> None:
            while not stop.wait(2.0):
                worker._heartbeat()

        threading.Thread(target=beat, daemon=True).start()
        api, port = start_api(url)
        print(
            f"# bench/streams.py: {cpu_name()}, "
            f"{os.cpu_count()} cores (shared with other work), open-files limit {limit}; "
            f"broker: {binary.describe()}, nothing saved; "
            f"`llmq api` defaults (2 gunicorn processes, gevent), LLMQ_MAX_QUEUE raised; "
            f"streams opened at {args.rate:.0f}/s; their jobs wait in the queue (no worker runs)"
        )
        for n in (int(x) for x in args.streams.split(",")):
            conn.flushdb()
            worker.register()
            result = asyncio.run(run_n(n, args.rate, port, conn, api))
            print(json.dumps(result))
    finally:
        stop.set()
        if api is not None:
            api.terminate()
            try:
                api.wait(30)
            except subprocess.TimeoutExpired:
                api.kill()
        conn.close()
        redis_server.stop()


if __name__ == "__main__":
    main()
