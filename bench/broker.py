"""The Redis a bench measures through, chosen once when the bench starts and handed to what
starts a system (bench/harness.py `System`), the way `llmq serve` chooses its broker:

- `RedisServer`: a real redis-server (workers/redis_server.py: the one on PATH, else the one
  installed with llmq), started on a free port for each system;
- `ExternalRedis`: a Redis the user names with `--redis-url` (its db is flushed), its version
  from INFO;
- `FakeRedis`: fakeredis's Python TCP server, only with `--fake-broker`. It is not a Redis
  (a worker's step write took 44-48 ms on it against 0.32 ms on redis-server, on the AVX2
  EPYC), so every table printed from it says so in its title (`mark_tables`).

Each names itself (`describe()`) for the setup line of every API figure.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib.metadata import version
from typing import Protocol

import redis

from workers.redis_server import (
    RedisBinary,
    RedisServerMissing,
    RedisServerProcess,
    find_redis_server,
    pings,
)
from workers.wire.broker import redact

FAKE_MARK = "[FAKE BROKER: fakeredis's Python server, not a Redis: figures not representative]"
START_TIMEOUT_SECONDS = 15.0
FAKE_SERVER = """
import sys
from fakeredis import TcpFakeServer
TcpFakeServer(("127.0.0.1", int(sys.argv[1])), server_type="redis").serve_forever()
"""


class Running(Protocol):
    """A broker a system talks to while it runs."""

    @property
    def url(self) -> str: ...

    def stop(self) -> None: ...


class Broker(Protocol):
    fake: bool

    def describe(self) -> str: ...

    def start(self, port: int, server_args: tuple[str, ...] = ()) -> Running: ...


@dataclass(frozen=True)
class RedisServer:
    """A real redis-server started for each system, with nothing saved."""

    binary: RedisBinary
    fake = False

    def describe(self) -> str:
        return self.binary.describe()

    def start(self, port: int, server_args: tuple[str, ...] = ()) -> RedisServerProcess:
        server = RedisServerProcess(self.binary, port, extra_args=server_args)
        server.start(START_TIMEOUT_SECONDS)
        return server


@dataclass(frozen=True)
class Attached:
    """A Redis this bench did not start: nothing to stop."""

    url: str

    def stop(self) -> None:
        pass


@dataclass(frozen=True)
class ExternalRedis:
    """The Redis at `url` (`--redis-url`); each system flushes its db first."""

    url: str
    version: str
    fake = False

    @classmethod
    def at(cls, url: str) -> ExternalRedis:
        with redis.Redis.from_url(url, socket_connect_timeout=5) as conn:
            return cls(url, str(conn.info("server")["redis_version"]))

    def describe(self) -> str:
        return f"Redis {self.version} at {redact(self.url)} (--redis-url)"

    def start(self, port: int, server_args: tuple[str, ...] = ()) -> Attached:
        _no_server_args(self, server_args)
        with redis.Redis.from_url(self.url) as conn:
            conn.flushdb()
        return Attached(self.url)


@dataclass
class FakeProcess:
    """fakeredis's TCP server in a child process."""

    process: subprocess.Popen[bytes]
    url: str

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@dataclass(frozen=True)
class FakeRedis:
    """fakeredis's `TcpFakeServer` in a child process (`--fake-broker` only)."""

    fake = True

    def describe(self) -> str:
        return f"fakeredis {version('fakeredis')} TcpFakeServer (--fake-broker) {FAKE_MARK}"

    def start(self, port: int, server_args: tuple[str, ...] = ()) -> FakeProcess:
        _no_server_args(self, server_args)
        argv = [sys.executable, "-c", FAKE_SERVER, str(port)]
        running = FakeProcess(subprocess.Popen(argv), f"redis://127.0.0.1:{port}/0")
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while not pings(running.url):
            if running.process.poll() is not None or time.monotonic() > deadline:
                running.stop()
                raise RuntimeError(f"fakeredis's server did not answer on port {port}")
            time.sleep(0.05)
        return running


def _no_server_args(broker: Broker, server_args: tuple[str, ...]) -> None:
    if server_args:
        raise ValueError(f"{broker.describe()} takes no redis-server options, got {server_args}")


def add_broker_args(p: argparse.ArgumentParser) -> None:
    """`--redis-url` and `--fake-broker`: without either, a real redis-server."""
    p.add_argument(
        "--redis-url",
        help="measure through the Redis at this URL instead of starting redis-server "
        "(its db is flushed)",
    )
    p.add_argument(
        "--fake-broker",
        action="store_true",
        help="where there is no redis-server: fakeredis's Python server (not a Redis; every "
        "table says so)",
    )


def broker_from_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> Broker:
    """The broker the options ask for; with none, redis-server from PATH or the one installed
    with llmq. No redis-server and no `--fake-broker` exits 2, saying what to install."""
    if args.fake_broker and args.redis_url:
        p.error("--fake-broker and --redis-url name two brokers: give one")
    if args.redis_url:
        try:
            return ExternalRedis.at(args.redis_url)
        except redis.RedisError as exc:
            p.exit(2, f"{p.prog}: no Redis answers at {redact(args.redis_url)}: {exc}\n")
    if args.fake_broker:
        if importlib.util.find_spec("fakeredis") is None:
            p.exit(2, f"{p.prog}: --fake-broker needs fakeredis (llmq's dev extra)\n")
        return FakeRedis()
    try:
        return RedisServer(find_redis_server())
    except RedisServerMissing as exc:
        p.exit(
            2,
            f"{p.prog}: {exc}. Benchmarks run on a real Redis; --fake-broker measures on "
            "fakeredis's Python server instead, and every table then says so\n",
        )


def mark_tables(text: str) -> str:
    """`text` with `FAKE_MARK` before the title (first line) of each of its blocks."""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line.strip() and (i == 0 or not lines[i - 1].strip()):
            lines[i] = f"{FAKE_MARK} {line}"
    return "\n".join(lines)
