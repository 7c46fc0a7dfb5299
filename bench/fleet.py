"""A SIMULATION of a fleet's token path: simulated workers, a real API, real Redis, real clients.

    python bench/fleet.py [--workers 4] [--processes 1] [--streams 256] [--rate 15]
                          [--tokens 64] [--seconds 20] [--redis-url URL] [--api-url URL]
                          [--api-checkout PATH] [--api-env NAME=VALUE ...]
                          [--events-cluster local|host:port,...]

No engine runs. `--workers` simulated workers (threads of `--processes` child processes: one
each where the cores allow) take jobs off the model's queues with the worker's own claim
script (`workers.claims`, a lease each) and write their token events through the worker's
own `EventWriter` exactly as `llmq worker`'s loop does (one step's writes for all its jobs
sent beside the next step, the outcome acted on after it), one token per running sequence
every 1/`--rate` seconds. `--streams` clients (asyncio over raw sockets,
bench/sse_client.py, one process) each keep one streamed completion open through a real
`llmq api` (started here from `--api-checkout` with its default settings but `--api-env`,
or `--api-url`) for `--seconds`, opening the next when one ends; so the jobs exist as the
API's records and every token is relayed by the API as it does for users. The client side
knows only HTTP and OpenAI's SSE. Also printed: the CPU time of the API's processes and of
the clients' per token relayed (all share the cores).

Each token's text is the worker's clock when its step made it ("@<unix time>|"), so every
chunk a client reads gives the lag from there (the step's write and the relay included) to
the bytes on the client's socket; all processes share this machine's clock. Redis is a real
redis-server (workers/redis_server.py: PATH's, else the one installed with llmq) started on
a free port, unless `--redis-url` names one (its db is flushed); the first lines name it.
Printed: Redis CPU per token (`used_cpu_sys` + `used_cpu_user` over the run, after CONFIG
RESETSTAT, and INFO commandstats' busiest commands), tokens a second written and delivered,
lag p50/p99/max, the time to each stream's response headers, Redis's connected clients and
the API's RSS at their peak, and every failure by kind (HTTP status, in-band error code such
as `broker_down`, transport errors, streams cut before `[DONE]`).

`--events-cluster` puts the token events and their leases on a Redis Cluster
(`LLMQ_EVENTS_CLUSTER`, for the simulated workers and the API alike; `local` starts a
3-shard one here): the Redis CPU is then printed per server (the queue Redis and each of the
cluster's primaries), with the tokens a second the busiest of them would carry at 100% of
its core (its CPU per token), which is what adding shards raises.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import psutil  # noqa: E402
import redis  # noqa: E402

from bench import token_path  # noqa: E402
from bench.harness import cpu_name  # noqa: E402
from bench.sse_client import HTTPStreamError, StreamedResponse  # noqa: E402
from bench.token_path import SimJob, result_body  # noqa: E402
from runtime.request import GenerationSpec  # noqa: E402
from tests.events_cluster import cluster_port_free  # noqa: E402
from workers import keys  # noqa: E402
from workers.claims import Claims  # noqa: E402
from workers.event_store import events_of  # noqa: E402
from workers.event_writer import EventWriter  # noqa: E402
from workers.leases import Leases  # noqa: E402
from workers.redis_server import (  # noqa: E402
    RedisBinary,
    RedisServerMissing,
    RedisServerProcess,
    find_redis_server,
)
from workers.supervisor import free_port  # noqa: E402
from workers.wire.broker import EVENTS_CLUSTER_ENV, EventsSettings, redact  # noqa: E402
from workers.wire.errors import cancelled_error  # noqa: E402
from workers.wire.events import token_event  # noqa: E402
from workers.wire.job import (  # noqa: E402
    CANCELLED,
    STARTED,
    JobRecord,
)
from workers.wire.worker_info import READY, WorkerInfo  # noqa: E402
from workers.worker import connect  # noqa: E402

MODEL = "fleet-sim"
CONTEXT = 4096
LEASE_SECONDS = 30
IDLE_SECONDS = 0.01  # an idle simulated worker looks for jobs this often
STAMP = "@"  # a token's text: STAMP + the send time + "|"
STAMPS = re.compile(rb"@(\d+\.\d+)\|")


# ----------------------------------------------------------------------------- workers


class SimWorker:
    """One simulated `llmq worker`: the real claim, lease, writer and ends of a job; a clock
    instead of an engine."""

    def __init__(
        self, url: str, name: str, rate: float, max_sequences: int, events_nodes: str = ""
    ) -> None:
        self.conn = connect(url)  # the worker's own client settings
        settings = EventsSettings.from_env({EVENTS_CLUSTER_ENV: events_nodes})
        # the token path's mode, chosen once here and handed to the parts below
        self.events = events_of(
            self.conn, settings.connect(self.conn, socket_timeout=5, socket_connect_timeout=2)
        )
        self.name = name
        self.interval = 1.0 / rate
        self.max_sequences = max_sequences
        self.leases = Leases(self.events, name, LEASE_SECONDS)
        self.claims = Claims(self.conn, self.leases, self.events)
        self.writer = EventWriter(self.conn, name, own_models=set(), events=self.events)
        served = [keys.queue_name(MODEL, kind) for kind in keys.QUEUE_KINDS]
        self.queues = [f"rq:queue:{name}" for name in served]
        self.info = WorkerInfo(
            name=name,
            pid=os.getpid(),
            host="fleet-sim",
            models=[MODEL],
            queues=served,
            pool={MODEL: {"state": READY, "memory_mb": 1.0, "in_flight": 0, "device": "cpu"}},
            max_sequences=max_sequences,
        )
        self.jobs: dict[str, SimJob] = {}
        self.written = 0
        self.errors: Counter[str] = Counter()

    def register(self) -> None:
        self.conn.hset(keys.MODELS, MODEL, json.dumps({"context_length": CONTEXT}))
        self.conn.sadd(keys.WORKERS, self.name)
        self.heartbeat()

    def heartbeat(self) -> None:
        self.info.heartbeat = time.time()
        self.info.current_jobs = list(self.jobs)
        self.conn.hset(keys.worker(self.name), mapping=self.info.to_hash())

    def run(self, stop: Any) -> None:
        beat = 0.0
        next_step = time.monotonic()
        while not stop.is_set():
            try:
                if time.monotonic() - beat > 1.0:
                    self.heartbeat()
                    beat = time.monotonic()
                self.claim()
                if not self.jobs:
                    self.act()
                    time.sleep(IDLE_SECONDS)
                    next_step = time.monotonic()
                    continue
                self.step()
                next_step += self.interval
                time.sleep(max(0.0, next_step - time.monotonic()))
            except redis.RedisError as exc:
                self.errors[type(exc).__name__] += 1
                time.sleep(0.1)
        try:
            self.writer.close()
        except redis.RedisError as exc:
            self.errors[type(exc).__name__] += 1

    def claim(self) -> None:
        while len(self.jobs) < self.max_sequences:
            claim = self.claims.take(self.queues)
            if claim is None:
                return
            if claim.attempt < 1:
                continue  # cancelled while queued, or its record is gone: never runs
            record = JobRecord.from_hash(self.conn.hgetall(keys.job(claim.job_id)))
            spec = GenerationSpec.from_record(record.spec or {})
            job = SimJob(record, claim.attempt, self.leases.name(claim.attempt), None, None)
            job.max_tokens = spec.max_tokens or 16
            job.written = self.events.client.xlen(keys.job_events(job.id))
            with self.conn.pipeline() as pipe:
                pipe.hset(keys.job(job.id), mapping={"status": STARTED, "worker": self.name})
                pipe.hsetnx(keys.job(job.id), "started_at", time.time())
                pipe.execute()
            self.jobs[job.id] = job

    def step(self) -> None:
        """One simulated decode step, then what the last step's writes found, then this
        step's writes sent beside the next: `LLMQWorker._tick`'s order."""
        stamp = f"{STAMP}{time.time():.6f}|"
        for job in self.jobs.values():
            if job.result is not None:
                continue
            last = job.tokens + 1 == job.max_tokens
            finish = "length" if last else None
            job.pending.append(token_event(0, job.tokens, stamp, job.tokens, None, finish, 1))
            job.tokens += 1
            self.written += 1
            if last:
                job.result = result_body(job, "")
        self.act()
        self.writer.send(list(self.jobs.values()), {MODEL: len(self.jobs)}, background=True)

    def act(self) -> None:
        flushed = self.writer.collect()
        for job in flushed.lost + flushed.finished:
            self.jobs.pop(job.id, None)
        for job in flushed.cancel_requested:  # the client went away
            if self.jobs.pop(job.id, None) is not None:
                self.writer.end(job, CANCELLED, cancelled_error())


def run_workers(
    url: str,
    names: list[str],
    rate: float,
    max_sequences: int,
    stop: Any,
    ready: Any,
    out: Any,
    events_nodes: str = "",
) -> None:
    """A child process: the simulated workers `names`, one thread each."""
    sims = [SimWorker(url, name, rate, max_sequences, events_nodes) for name in names]
    for sim in sims:
        sim.register()
    threads = [threading.Thread(target=sim.run, args=(stop,), daemon=True) for sim in sims]
    for thread in threads:
        thread.start()
    ready.set()
    for thread in threads:
        thread.join()
    errors: Counter[str] = Counter()
    for sim in sims:
        errors.update(sim.errors)
    out.put({"written": sum(sim.written for sim in sims), "errors": dict(errors)})


# ----------------------------------------------------------------------------- clients


@dataclass
class ClientStats:
    streams: int = 0
    completed: int = 0
    tokens: int = 0
    lags: list[float] = field(default_factory=list)
    headers: list[float] = field(default_factory=list)
    failures: Counter[str] = field(default_factory=Counter)
    first_token: float | None = None
    last_token: float | None = None


async def one_stream(host: str, port: int, tokens: int, stats: ClientStats) -> None:
    body = {"model": MODEL, "prompt": "simulated", "max_tokens": tokens, "stream": True}
    started = time.time()
    stats.streams += 1
    try:
        response = await StreamedResponse.post(host, port, "/v1/completions", body)
    except HTTPStreamError as exc:
        stats.failures[str(exc)] += 1
        return
    try:
        stats.headers.append(time.time() - started)
        if response.status != 200:
            code = _error_code((await response.read()).decode(errors="replace"))
            stats.failures[f"HTTP {response.status} {code}".strip()] += 1
            return
        async for chunk in response.chunks():
            if _take_chunk(chunk, time.time(), stats):
                stats.completed += 1
                return
        stats.failures["cut before [DONE]"] += 1
    except HTTPStreamError as exc:
        stats.failures[str(exc)] += 1
    finally:
        response.close()


def _take_chunk(chunk: bytes, now: float, stats: ClientStats) -> bool:
    """Count the tokens of one body chunk (one or more SSE events) by their stamps; True
    at `[DONE]`. The stamps are found in the raw bytes: decoding every event's JSON cost
    this process more than the API spent relaying it."""
    for line in chunk.split(b"\n"):
        if not line.startswith(b"data: "):
            continue
        payload = line[6:]
        if payload == b"[DONE]":
            return True
        if b'"error"' in payload:
            error = json.loads(payload).get("error") or {}
            stats.failures[f"in-band error {error.get('code') or error.get('type')}"] += 1
            continue
        for stamp in STAMPS.findall(payload):
            stats.lags.append(now - float(stamp))
            stats.tokens += 1
            stats.first_token = stats.first_token or now
            stats.last_token = now
    return False


def _error_code(text: str) -> str:
    try:
        error = json.loads(text).get("error") or {}
    except (ValueError, AttributeError):
        return ""
    return str(error.get("code") or error.get("type") or "")


async def run_clients(url: str, streams: int, tokens: int, seconds: float) -> ClientStats:
    stats = ClientStats()
    deadline = time.monotonic() + seconds
    address = urlsplit(url)
    host, port = address.hostname or "127.0.0.1", address.port or 80

    async def client_loop() -> None:
        while time.monotonic() < deadline:
            await one_stream(host, port, tokens, stats)

    await asyncio.gather(*(client_loop() for _ in range(streams)))
    return stats


# ----------------------------------------------------------------------------- processes


class Peaks:
    """Redis's connected clients and the API's RSS (its whole process tree), sampled."""

    def __init__(self, conn: redis.Redis, api_pid: int | None) -> None:
        self.conn, self.api_pid = conn, api_pid
        self.clients = 0
        self.rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self.clients = max(
                    self.clients, int(self.conn.info("clients")["connected_clients"])
                )
                if self.api_pid is not None:
                    root = psutil.Process(self.api_pid)
                    tree = [root, *root.children(recursive=True)]
                    self.rss = max(self.rss, sum(p.memory_info().rss for p in tree))
            except (redis.RedisError, psutil.Error):
                pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU time of a process and its children (the API's gunicorn tree; this
    process's own, the clients', with `os.getpid()` and no children)."""
    if pid is None:
        return 0.0
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
        return sum(p.cpu_times().user + p.cpu_times().system for p in tree)
    except psutil.Error:
        return 0.0


@functools.cache
def redis_binary() -> RedisBinary:
    """The real redis-server the simulation starts (workers/redis_server.py), found once."""
    try:
        return find_redis_server()
    except RedisServerMissing as exc:
        raise SystemExit(f"fleet: {exc}") from None


def start_redis(binary: RedisBinary, tmp: Path) -> RedisServerProcess:
    server = RedisServerProcess(binary, free_port(), extra_args=("--dir", str(tmp)))
    server.start()
    return server


def start_api(
    redis_url: str, log: Any, checkout: Path = REPO, settings: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """`llmq api` as a user starts it, with its defaults (but `settings`), from `checkout`'s
    code."""
    port = free_port()
    env = {**os.environ, **(settings or {})}
    env.update({"REDIS_URL": redis_url, "HOST": "127.0.0.1", "PORT": str(port)})
    env["PYTHONPATH"] = str(checkout)
    env.pop("LLMQ_API_KEYS", None)
    argv = [sys.executable, "-m", "llmq", "api", "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(argv, cwd=checkout, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("fleet: the API did not start (see its log)")


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def start_cluster(
    binary: RedisBinary, tmp: Path, shards: int = 3
) -> tuple[list[RedisServerProcess], str]:
    """A local Redis Cluster of `shards` primaries (no replicas, nothing saved): its
    servers and `LLMQ_EVENTS_CLUSTER`'s value."""
    if binary.cli is None:
        raise SystemExit(f"fleet: no redis-cli beside {binary.server} or on PATH")
    ports: list[int] = []
    while len(ports) < shards:
        port = free_port()
        if port not in ports and cluster_port_free(port):
            ports.append(port)
    servers = []
    for port in ports:
        args = ("--dir", str(tmp), "--cluster-enabled", "yes")
        args += ("--cluster-config-file", f"nodes-{port}.conf")
        servers.append(RedisServerProcess(binary, port, extra_args=args))
        servers[-1].start()
    create = [str(binary.cli), "--cluster", "create"]
    create += [f"127.0.0.1:{port}" for port in ports]
    create += ["--cluster-replicas", "0", "--cluster-yes"]
    subprocess.run(create, check=True, stdout=subprocess.DEVNULL, timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        infos = [redis.Redis(port=p).execute_command("CLUSTER INFO") for p in ports]
        if all(info.get("cluster_state") == "ok" for info in infos):
            break
        time.sleep(0.1)
    return servers, ",".join(f"127.0.0.1:{port}" for port in ports)


def cluster_primaries(nodes: str) -> tuple[Any, list[redis.Redis]]:
    """The events cluster's client (`nodes`: its startup nodes), to close at the end, and a
    client of each of its primaries (theirs: closed with it)."""
    events = EventsSettings.from_env({EVENTS_CLUSTER_ENV: nodes}).connect(redis.Redis())
    return events, [events.get_redis_connection(node) for node in events.get_primaries()]


# ----------------------------------------------------------------------------- report


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(args: argparse.Namespace, stats: ClientStats, run: dict[str, Any]) -> None:
    written, cpu, wall = run["written"], run["cpu_s"], run["wall_s"]
    span = (stats.last_token or 0) - (stats.first_token or 0)
    print(
        f"streams opened {stats.streams}, completed {stats.completed}; "
        f"tokens written {written}, delivered {stats.tokens}"
    )
    print(
        f"tokens a second: written {written / wall:.0f}, "
        f"delivered {stats.tokens / max(span, 1e-9):.0f}"
    )
    if written:
        print(
            f"Redis CPU per token written (used_cpu sys+user, writes and relay): "
            f"{cpu * 1e6 / written:.2f} us ({cpu / wall * 100:.0f}% of one core)"
        )
        busiest = max(run["per_server"].values())
        for server, seconds in run["per_server"].items():
            print(
                f"  {server}: {seconds * 1e6 / written:.2f} us a token "
                f"({seconds / wall * 100:.0f}% of its core)"
            )
        print(
            f"the busiest server at 100% of its core would carry "
            f"{written / max(busiest, 1e-9):.0f} tokens a second (its CPU per token)"
        )
    if stats.tokens and run.get("api_cpu_s"):
        api = run["api_cpu_s"]
        print(
            f"API CPU (all its processes) per token relayed: {api * 1e6 / stats.tokens:.1f} us "
            f"({api / wall:.2f} cores; one core's worth would relay "
            f"{stats.tokens / api:.0f} tokens a second at this mix of submissions and "
            f"streams); the clients' process: {run['clients_cpu_s'] * 1e6 / stats.tokens:.1f} "
            "us a token"
        )
    ms = [lag * 1e3 for lag in stats.lags]
    print(
        f"lag send -> client socket: p50 {pct(ms, 0.5):.1f} ms, p99 {pct(ms, 0.99):.1f} ms, "
        f"max {max(ms, default=float('nan')):.1f} ms"
    )
    headers = stats.headers
    within = sum(1 for h in headers if h <= 1.0)
    print(
        f"response headers: {within} of {len(headers)} within 1 s; p50 {pct(headers, 0.5):.2f} s, "
        f"p99 {pct(headers, 0.99):.2f} s, max {max(headers, default=float('nan')):.2f} s"
    )
    print(f"peaks: Redis connected clients {run['clients']}, API RSS {run['rss'] / 2**20:.0f} MiB")
    failures = dict(stats.failures)
    print(f"failures: {failures or 'none'}; worker errors: {run['worker_errors'] or 'none'}")
    print("busiest Redis commands (a script's commands are also inside its own time):")
    print(f"  {'command':24} {'us/call':>8} {'calls':>9} {'us/token':>9}")
    top = sorted(run["stats"].items(), key=lambda kv: -float(kv[1]["usec"]))[:10]
    for name, s in top:
        per_token = float(s["usec"]) / max(written, 1)
        print(f"  {name:24} {float(s['usec_per_call']):8.2f} {int(s['calls']):9d} {per_token:9.2f}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4, help="simulated workers")
    parser.add_argument("--streams", type=int, default=256, help="concurrent streaming clients")
    parser.add_argument("--rate", type=float, default=15.0, help="tokens a second per sequence")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long clients open streams")
    parser.add_argument("--max-sequences", type=int, default=0, help="per worker (0: all streams)")
    parser.add_argument(
        "--processes", type=int, default=1, help="processes the simulated workers run in"
    )
    parser.add_argument(
        "--redis-url", help="a Redis to use (its db is flushed); else one is started"
    )
    parser.add_argument("--api-url", help="a running API on that Redis; else `llmq api` is started")
    parser.add_argument(
        "--api-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a setting of the API started here, e.g. LLMQ_API_THREADS=272",
    )
    parser.add_argument(
        "--api-checkout", type=Path, default=REPO, help="the checkout whose `llmq api` is started"
    )
    parser.add_argument(
        "--events-cluster",
        default="",
        help="the token events on a Redis Cluster: `local` (3 shards started here) or its nodes",
    )
    args = parser.parse_args(argv)
    max_sequences = args.max_sequences or max(1, -(-args.streams // args.workers))
    print(
        f"fleet: SIMULATION, no engine: {args.workers} simulated workers x up to {max_sequences} "
        f"sequences at {args.rate:g} tok/s each, {args.streams} streaming clients for "
        f"{args.seconds:g} s, {args.tokens} tokens a stream; {cpu_name()}, {os.cpu_count()} CPUs "
        f"(the simulator, the API, Redis and the clients share them)"
    )
    tmp = Path(tempfile.mkdtemp(prefix="llmq-fleet-"))
    api_proc = None
    servers_here: list[RedisServerProcess] = []  # what this run started, stopped at its end
    ctx = multiprocessing.get_context("spawn")
    stop_event, out = ctx.Event(), ctx.Queue()
    workers: list[Any] = []
    readiness: list[Any] = []
    closing: list[Any] = []  # clients this run opened, closed at its end
    try:
        if args.redis_url:
            url = args.redis_url
        else:
            servers_here.append(start_redis(redis_binary(), tmp))
            url = servers_here[0].url
        conn = redis.Redis.from_url(url)
        closing.append(conn)
        conn.flushdb()
        version = conn.info("server")["redis_version"]
        broker = f"Redis {version} (--redis-url)" if args.redis_url else redis_binary().describe()
        nodes = args.events_cluster
        if nodes == "local":
            cluster, nodes = start_cluster(redis_binary(), tmp)
            servers_here += cluster
        cluster_client, shards = cluster_primaries(nodes) if nodes else (None, [])
        if cluster_client is not None:
            closing.append(cluster_client)
        for shard in shards:
            shard.flushall()
        if nodes:
            print(f"token events on a Redis Cluster of {len(shards)} primaries: {nodes}")
        print(
            f"broker: {broker} at {redact(url)}; API from "
            f"{args.api_url or args.api_checkout} {' '.join(args.api_env)}"
        )
        with open(tmp / "api.log", "wb") as log:
            if args.api_url:
                base = args.api_url
            else:
                settings = dict(item.split("=", 1) for item in args.api_env)
                if nodes:
                    settings[EVENTS_CLUSTER_ENV] = nodes
                api_proc, base = start_api(url, log, args.api_checkout, settings)
            for p in range(min(args.processes, args.workers)):
                names = [f"fleet-sim-{i}" for i in range(p, args.workers, args.processes)]
                readiness.append(ctx.Event())
                sim = (url, names, args.rate, max_sequences, stop_event, readiness[-1], out, nodes)
                workers.append(ctx.Process(target=run_workers, args=sim))
                workers[-1].start()
            for ready in readiness:
                ready.wait(30)
            time.sleep(1.0)  # registered and heartbeating before the API is asked
            peaks = Peaks(conn, api_proc.pid if api_proc else None)
            servers = {"queue Redis": conn}
            servers.update({f"cluster {s.get_connection_kwargs()['port']}": s for s in shards})
            for server in servers.values():
                server.config_resetstat()
            cpu0 = {name: token_path.redis_cpu(server) for name, server in servers.items()}
            api_pid = api_proc.pid if api_proc else None
            api_cpu0, clients_cpu0 = cpu_seconds(api_pid), time.process_time()
            t0 = time.monotonic()
            stats = asyncio.run(run_clients(base, args.streams, args.tokens, args.seconds))
            wall = time.monotonic() - t0
            api_cpu = cpu_seconds(api_pid) - api_cpu0
            clients_cpu = time.process_time() - clients_cpu0
            per_server = {name: token_path.redis_cpu(s) - cpu0[name] for name, s in servers.items()}
            cpu = sum(per_server.values())
            commandstats = token_path.command_stats(conn)
            for shard in shards:
                token_path.add_cluster_stats(commandstats, shard)
            peaks.stop()
            stop_event.set()
            written, worker_errors = 0, Counter[str]()
            for _ in workers:
                result = out.get(timeout=30)
                written += result["written"]
                worker_errors.update(result["errors"])
            for process in workers:
                process.join(30)
        run = {
            "written": written,
            "worker_errors": dict(worker_errors),
            "cpu_s": cpu,
            "per_server": per_server,
            "wall_s": wall,
            "stats": commandstats,
            "clients": peaks.clients,
            "api_cpu_s": api_cpu,
            "clients_cpu_s": clients_cpu,
            "rss": peaks.rss,
        }
        report(args, stats, run)
        print(f"(API log: {tmp / 'api.log'})")
        return {**run, "streams": stats}
    finally:
        stop_event.set()
        for process in workers:
            if process.is_alive():
                process.terminate()
        stop(api_proc)
        for client in closing:
            client.close()
        for server in servers_here:
            server.stop()


if __name__ == "__main__":
    main()
