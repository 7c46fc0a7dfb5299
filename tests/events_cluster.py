"""A real local Redis Cluster for tests of the events cluster (`LLMQ_EVENTS_CLUSTER`): three
`redis-server --cluster-enabled yes` primaries (no replicas, nothing saved) joined by
`redis-cli --cluster create`, ready once every node says `cluster_state:ok`, stopped and
removed afterwards. Ports are the first free ones (and their cluster bus ports, +10000) from
$LLMQ_TEST_CLUSTER_PORT (default 7401)."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from tests.redis_db import redis_binary, redis_cli

BASE_PORT_ENV = "LLMQ_TEST_CLUSTER_PORT"
DEFAULT_BASE_PORT = 7401
NODES = 3
READY_SECONDS = 30


def cluster_port_free(port: int) -> bool:
    """Whether a cluster node can listen on loopback at `port` and its bus port (+10000)."""
    if port + 10000 > 65535:
        return False
    for candidate in (port, port + 10000):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", candidate))
            except OSError:
                return False
    return True


def free_ports(count: int, start: int) -> list[int]:
    ports: list[int] = []
    port = start
    while len(ports) < count and port < start + 1000:
        if cluster_port_free(port):
            ports.append(port)
        port += 1
    if len(ports) < count:
        pytest.fail(f"no {count} free ports (and bus ports) from {start}")
    return ports


def _cluster_ok(port: int) -> bool:
    try:
        with redis.Redis(port=port, socket_connect_timeout=1) as node:
            info = node.execute_command("CLUSTER INFO")  # redis-py parses it into a dict
            return info.get("cluster_state") == "ok"
    except redis.ConnectionError:
        return False


@contextmanager
def local_cluster(folder: Path, nodes: int = NODES) -> Iterator[list[int]]:
    """The ports of a running `nodes`-shard cluster; everything stopped at the end."""
    ports = free_ports(nodes, int(os.environ.get(BASE_PORT_ENV, DEFAULT_BASE_PORT)))
    servers = []
    try:
        for port in ports:
            argv = [str(redis_binary().server), "--port", str(port), "--bind", "127.0.0.1"]
            argv += ["--cluster-enabled", "yes", "--save", "", "--appendonly", "no"]
            argv += ["--cluster-config-file", str(folder / f"nodes-{port}.conf")]
            argv += ["--dir", str(folder)]
            servers.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL))
        _wait(lambda: all(_pings(p) for p in ports), "the cluster's nodes to start")
        create = [redis_cli(), "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports)]
        create += ["--cluster-replicas", "0", "--cluster-yes"]
        subprocess.run(create, check=True, stdout=subprocess.DEVNULL, timeout=READY_SECONDS)
        _wait(lambda: all(_cluster_ok(p) for p in ports), "cluster_state:ok on every node")
        yield ports
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            server.wait(10)


def _pings(port: int) -> bool:
    try:
        with redis.Redis(port=port, socket_connect_timeout=1) as node:
            return bool(node.ping())
    except redis.ConnectionError:
        return False


def _wait(ready: object, what: str) -> None:
    deadline = time.monotonic() + READY_SECONDS
    while not ready():  # type: ignore[operator]
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def flush(ports: list[int]) -> None:
    """Empty every node (between tests sharing one cluster)."""
    for port in ports:
        with redis.Redis(port=port) as node:
            node.flushall()
