"""A Redis master, its replicas and three Sentinels on loopback, for docs/faults.md F20.

Every server is this test's own (free ports, a temp dir, no persistence); a Sentinel says a
master is down after 1 s without an answer, so a failover takes a few seconds.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import redis

from tests.redis_db import redis_binary
from tests.workers.conftest import wait_for
from workers.supervisor import free_port

MASTER_NAME = "llmq-f20"
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 3000


class Server:
    """One redis-server: a master, or a replica of one."""

    def __init__(self, directory: Path, replica_of: int | None = None, port: int = 0) -> None:
        self.port = port or free_port()
        self.directory = directory / f"redis-{self.port}"
        self.directory.mkdir(exist_ok=True)
        self.process = self._start(replica_of)

    def _start(self, replica_of: int | None) -> subprocess.Popen[bytes]:
        argv = [str(redis_binary().server), "--port", str(self.port)]
        argv += ["--bind", "127.0.0.1", "--dir", str(self.directory), "--save", ""]
        argv += ["--appendonly", "no", "--repl-diskless-sync-delay", "0"]
        if replica_of is not None:
            argv += ["--replicaof", "127.0.0.1", str(replica_of)]
        process = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
        wait_for(self.pings, 10, f"redis-server on port {self.port}")
        return process

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2, socket_connect_timeout=1)

    def role(self) -> str | None:
        """`master` or `slave` as the server says now; None when it does not answer."""
        try:
            with self.client() as conn:
                return str(conn.info("replication")["role"])
        except redis.RedisError:
            return None

    def pings(self) -> bool:
        try:
            with self.client() as conn:
                return bool(conn.ping())
        except redis.ConnectionError:
            return False

    def kill(self) -> None:
        """kill -9: no chance to pass anything on."""
        self.process.kill()
        self.process.wait(10)

    def pause(self) -> None:
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.resume()
            self.process.kill()
            self.process.wait(10)


class SentinelCluster:
    """A master, `replicas` replicas and three Sentinels watching them as `MASTER_NAME`."""

    def __init__(self, directory: Path, replicas: int = 2) -> None:
        self.directory = directory
        master = Server(directory)
        self.servers = [master] + [Server(directory, master.port) for _ in range(replicas)]
        self.sentinels: list[subprocess.Popen[bytes]] = []
        self.sentinel_ports = [free_port() for _ in range(3)]
        for port in self.sentinel_ports:
            self.sentinels.append(self._sentinel(port, master.port))
        wait_for(lambda: self.replicas_online() == replicas, 20, "replicas in sync")
        wait_for(self._sentinels_see_everything, 20, "Sentinels to see each other")

    @property
    def env(self) -> dict[str, str]:
        """How llmq finds this master."""
        ports = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return {"REDIS_SENTINELS": ports, "REDIS_MASTER_NAME": MASTER_NAME}

    def _sentinel(self, port: int, master_port: int) -> subprocess.Popen[bytes]:
        conf = self.directory / f"sentinel-{port}.conf"
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {self.directory}\n"
            f"logfile {self._sentinel_log(port)}\n"
            f"sentinel monitor {MASTER_NAME} 127.0.0.1 {master_port} 2\n"
            f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}\n"
            f"sentinel parallel-syncs {MASTER_NAME} 2\n"
        )
        server = str(redis_binary().server)  # redis-sentinel is redis-server --sentinel
        return subprocess.Popen([server, str(conf), "--sentinel"], stdout=subprocess.DEVNULL)

    def _sentinel_log(self, port: int) -> Path:
        return self.directory / f"sentinel-{port}.log"

    def report(self, log_lines: int = 15) -> str:
        """Each server's role and link and the tail of each Sentinel's log: what a failed
        wait on Sentinel's pace prints, so that the cause can be read from CI's output."""
        lines = []
        for server in self.servers:
            try:
                with server.client() as conn:
                    info = conn.info("replication")
                keys = ("role", "master_port", "master_link_status", "connected_slaves")
                lines.append(f"redis {server.port}: " + str({k: info.get(k) for k in keys}))
            except redis.RedisError as error:
                lines.append(f"redis {server.port}: {error!r}")
        for port in self.sentinel_ports:
            log = self._sentinel_log(port)
            tail = log.read_text(errors="replace").splitlines()[-log_lines:] if log.exists() else []
            lines.append(f"sentinel {port}:\n  " + "\n  ".join(tail))
        return "\n".join(lines)

    def _sentinel_client(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1)

    def _sentinels_see_everything(self) -> bool:
        try:
            for port in self.sentinel_ports:
                with self._sentinel_client(port) as conn:
                    info = conn.sentinel_master(MASTER_NAME)
                    if info["num-other-sentinels"] < 2 or info["num-slaves"] < 1:
                        return False
            return True
        except redis.RedisError:
            return False

    def master_port(self) -> int | None:
        """The master's port as the Sentinels name it (None while none answers)."""
        for port in self.sentinel_ports:
            try:
                with self._sentinel_client(port) as conn:
                    address = conn.sentinel_get_master_addr_by_name(MASTER_NAME)
                if address:
                    return int(address[1])
            except redis.RedisError:
                continue
        return None

    def agreed_master(self) -> Server | None:
        """The master every Sentinel names and that answers as master; None while they
        disagree or it does not (an election, a failover under way, a server not yet
        promoted)."""
        named = set()
        for port in self.sentinel_ports:
            try:
                with self._sentinel_client(port) as conn:
                    address = conn.sentinel_get_master_addr_by_name(MASTER_NAME)
            except redis.RedisError:
                return None
            named.add(int(address[1]) if address else None)
        if len(named) != 1 or None in named:
            return None
        server = next((s for s in self.servers if s.port in named), None)
        return server if server is not None and server.role() == "master" else None

    def failovers(self) -> int:
        """Failovers the Sentinels have made so far (`+switch-master` in their logs, which
        each Sentinel writes once per failover it learns of)."""
        counts = []
        for port in self.sentinel_ports:
            log = self._sentinel_log(port)
            text = log.read_text(errors="replace") if log.exists() else ""
            counts.append(text.count("+switch-master"))
        return max(counts)

    def master(self) -> Server:
        port = self.master_port()
        return next(s for s in self.servers if s.port == port)

    def replicas_online(self) -> int:
        """Replicas the current master has in sync (`INFO replication`)."""
        try:
            with self.master().client() as conn:
                info = conn.info("replication")
        except (redis.RedisError, StopIteration):
            return 0
        return sum(
            1
            for k, v in info.items()
            if k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online"
        )

    def kill_master(self, timeout: float = 30) -> tuple[Server, Server, float]:
        """kill -9 the master; wait until the Sentinels name another one and it answers as
        master. Returns the old and new master and the seconds between."""
        old = self.master()
        old.kill()
        killed_at = time.monotonic()

        def promoted() -> Server | None:
            port = self.master_port()
            if port is None or port == old.port:
                return None
            new = next(s for s in self.servers if s.port == port)
            try:
                with new.client() as conn:
                    role = conn.info("replication")["role"]
            except redis.RedisError:
                return None
            return new if role == "master" else None

        new = wait_for(promoted, timeout, "a new master")
        return old, new, time.monotonic() - killed_at

    def rejoin(self, old: Server) -> Server:
        """Start a killed server again on its port as a replica of the current master, so
        that the next failover still leaves the new master a replica to confirm writes."""
        self.servers.remove(old)
        server = Server(self.directory, self.master().port, port=old.port)
        self.servers.append(server)
        return server

    def stop(self) -> None:
        for sentinel in self.sentinels:
            if sentinel.poll() is None:
                sentinel.kill()
                sentinel.wait(10)
        for server in self.servers:
            server.stop()
