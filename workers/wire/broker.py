"""The one place a Redis client is built: one server (`REDIS_URL`) or the master that Redis
Sentinel names (`REDIS_SENTINELS`, `REDIS_MASTER_NAME`), for the API, the workers, `llmq
serve` and the CLI alike (docs/architecture.md: a failover is handled in one place).

A Sentinel client (redis-py's `Sentinel.master_for`) asks the Sentinels for the master on
every new connection, so after a failover the next connection goes to the new master
without a restart. While there is no master (the election) redis-py raises
`MasterNotFoundError`, and a connection still open to a demoted master turns its
`READONLY` answer into a `ConnectionError`: both are connection errors, which every room
already treats as a broker outage (503 + Retry-After in the API, back-off in a worker).

With Sentinels, an acknowledgement waits for replication (`Replication`): Redis
replicates asynchronously, so a job acknowledged by a master that dies a millisecond later
would be lost with it. `WAIT` after the submission's last write makes the 202 mean "on
`LLMQ_REDIS_MIN_REPLICAS` replicas too" (docs/faults.md F20).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.sentinel import Sentinel

from workers import keys

URL_ENV = "REDIS_URL"
SENTINELS_ENV = "REDIS_SENTINELS"
MASTER_NAME_ENV = "REDIS_MASTER_NAME"
MIN_REPLICAS_ENV = "LLMQ_REDIS_MIN_REPLICAS"
# credentials and database of the master and replicas when they are found through Sentinel
# (with REDIS_URL they are part of the URL)
PASSWORD_ENV = "REDIS_PASSWORD"
USERNAME_ENV = "REDIS_USERNAME"
DB_ENV = "REDIS_DB"
# startup nodes of the Redis Cluster that holds every job's event stream and lease
# (`EventsSettings`); unset, they stay on the queue Redis
EVENTS_CLUSTER_ENV = "LLMQ_EVENTS_CLUSTER"

DEFAULT_URL = "redis://127.0.0.1:6379/0"
DEFAULT_MASTER_NAME = "mymaster"
DEFAULT_MIN_REPLICAS = 1
ACK_TIMEOUT_MS = 1000  # a submission whose write no replica confirms this soon gets a 503
SENTINEL_SOCKET_TIMEOUT = 0.5  # a dead Sentinel costs this much of a reconnect, not more


# What a room treats as "the broker is away for now": a lost connection, a stalled one, no
# master elected yet (`MasterNotFoundError` is a ConnectionError), or a write refused by a
# demoted master whose client is not a Sentinel one (a Sentinel client turns it into a
# ConnectionError itself).
BROKER_LOST: tuple[type[Exception], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.ReadOnlyError,
)


class PoolExhausted(redis.RedisError):
    """Every connection of a bounded pool stayed in use for the pool's whole timeout: the
    process is busy, Redis is not down. Deliberately not a ConnectionError, so no room
    mistakes it for a broker outage (the API answers it 503 `redis_pool_exhausted`)."""


class BoundedPool(redis.BlockingConnectionPool):
    """redis-py's blocking pool (a caller waits for a free connection instead of failing at
    the cap, as `ConnectionPool` does with `MaxConnectionsError`), whose timeout raises
    `PoolExhausted` rather than the ConnectionError redis-py raises for it."""

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().get_connection(*args, **kwargs)
        except redis.ConnectionError as exc:
            if exc.args != ("No connection available.",):  # redis-py's words for the timeout
                raise
            raise PoolExhausted(
                f"all {self.max_connections} Redis connections of this process stayed busy "
                f"for {self.timeout} s"
            ) from None

    def in_use(self) -> int:
        """Connections handed out now (made, and not back in the pool)."""
        idle = sum(1 for conn in list(self.pool.queue) if conn is not None)
        return len(self._connections) - idle


class BrokerConfigError(ValueError):
    """The broker settings contradict each other or cannot be read."""


class NotReplicated(redis.ConnectionError):
    """Fewer replicas than `LLMQ_REDIS_MIN_REPLICAS` confirmed a write within the timeout,
    or the key it guards is gone (the write went to a master that has since been replaced).
    A connection error: every room already answers those with 503 or a retry."""

    def __init__(self, acked: int, wanted: int, guard: str | None = None) -> None:
        self.acked, self.wanted = acked, wanted
        if guard is not None:
            message = f"{guard} is not on the current master (written before a failover)"
        else:
            message = f"{acked} of {wanted} replicas confirmed the write within the timeout"
        super().__init__(message)


@dataclass(frozen=True)
class BrokerSettings:
    """Where Redis is: `url`, or `sentinels` watching `master_name`. Read them with
    `from_env`; build clients with `connect`."""

    url: str | None = DEFAULT_URL
    sentinels: tuple[tuple[str, int], ...] = ()
    master_name: str = DEFAULT_MASTER_NAME
    min_replicas: int = DEFAULT_MIN_REPLICAS
    # how to reach the Sentinels themselves (their password, TLS): redis-py's sentinel_kwargs
    sentinel_kwargs: Mapping[str, Any] = field(default_factory=dict)
    # how to reach the master and replicas once named (password, username, db, TLS)
    server_kwargs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def uses_sentinel(self) -> bool:
        return bool(self.sentinels)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, url: str | None = None
    ) -> BrokerSettings:
        """Read the environment; `url` (a `--redis-url` option) stands for `REDIS_URL`.
        Setting both a URL and Sentinels is an error: which one is meant is a guess."""
        env = os.environ if environ is None else environ
        url = url or env.get(URL_ENV) or None
        spec = env.get(SENTINELS_ENV, "").strip()
        min_replicas = _min_replicas(env.get(MIN_REPLICAS_ENV))
        if not spec:
            return cls(url=url or DEFAULT_URL, min_replicas=min_replicas)
        if url:
            raise BrokerConfigError(
                f"set either {URL_ENV} (one Redis) or {SENTINELS_ENV} (Redis Sentinel), not both"
            )
        sentinels, sentinel_kwargs = parse_sentinels(spec)
        server_kwargs: dict[str, Any] = {"db": _db(env.get(DB_ENV))}
        if env.get(PASSWORD_ENV):
            server_kwargs["password"] = env[PASSWORD_ENV]
        if env.get(USERNAME_ENV):
            server_kwargs["username"] = env[USERNAME_ENV]
        if sentinel_kwargs.get("ssl"):
            server_kwargs["ssl"] = True  # rediss:// Sentinels: the servers speak TLS too
        return cls(
            url=None,
            sentinels=sentinels,
            master_name=env.get(MASTER_NAME_ENV) or DEFAULT_MASTER_NAME,
            min_replicas=min_replicas,
            sentinel_kwargs=sentinel_kwargs,
            server_kwargs=server_kwargs,
        )

    def connect(
        self,
        *,
        max_connections: int | None = None,
        pool_timeout: float = 10.0,
        **client_kwargs: Any,
    ) -> redis.Redis:
        """A client of the master. `client_kwargs` (timeouts, retry policy) are the
        caller's; the address, credentials and TLS are these settings'. With
        `max_connections`, one URL gets a `BoundedPool` (callers wait up to `pool_timeout`
        for a connection); Sentinel's pool is capped at it (redis-py has no blocking
        Sentinel pool; at the cap it raises `MaxConnectionsError`)."""
        if not self.uses_sentinel:
            assert self.url is not None
            if max_connections is None:
                return redis.Redis.from_url(self.url, **client_kwargs)
            pool = BoundedPool.from_url(
                self.url, max_connections=max_connections, timeout=pool_timeout, **client_kwargs
            )
            return redis.Redis(connection_pool=pool)
        if max_connections is not None:
            client_kwargs["max_connections"] = max_connections
        timeout = client_kwargs.get("socket_connect_timeout") or SENTINEL_SOCKET_TIMEOUT
        sentinel_kwargs = {
            "socket_timeout": min(timeout, SENTINEL_SOCKET_TIMEOUT),
            "socket_connect_timeout": min(timeout, SENTINEL_SOCKET_TIMEOUT),
            **self.sentinel_kwargs,
        }
        sentinel = Sentinel(list(self.sentinels), sentinel_kwargs=sentinel_kwargs)
        return sentinel.master_for(self.master_name, **{**self.server_kwargs, **client_kwargs})

    def describe(self) -> str:
        """For logs: where Redis is, without any password."""
        if not self.uses_sentinel:
            return redact(self.url or "")
        hosts = ",".join(f"{h}:{p}" for h, p in self.sentinels)
        return f"sentinel {self.master_name} via {hosts}"

    def env(self) -> dict[str, str]:
        """The variables that hand these settings to a child process (`llmq serve`)."""
        if not self.uses_sentinel:
            return {URL_ENV: self.url or DEFAULT_URL}
        return {}  # the child reads REDIS_SENTINELS and the rest from the same environment


def parse_sentinels(spec: str) -> tuple[tuple[tuple[str, int], ...], dict[str, Any]]:
    """`host:port,host:port`, or with a scheme and credentials for the Sentinels themselves:
    `rediss://user:password@host:port,host:port` (the first entry's scheme and credentials
    apply to every Sentinel). Returns the addresses and redis-py's `sentinel_kwargs`."""
    kwargs: dict[str, Any] = {}
    addresses = []
    for i, part in enumerate(p.strip() for p in spec.split(",")):
        if not part:
            continue
        if "://" in part:
            parts = urlsplit(part)
            if parts.scheme not in ("redis", "rediss"):
                raise BrokerConfigError(
                    f"{SENTINELS_ENV}: scheme must be redis:// or rediss://, got {part!r}"
                )
            if i == 0:
                if parts.scheme == "rediss":
                    kwargs["ssl"] = True
                if parts.password:
                    kwargs["password"] = unquote(parts.password)
                if parts.username:
                    kwargs["username"] = unquote(parts.username)
            part = parts.netloc.rpartition("@")[2]
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise BrokerConfigError(
                f"{SENTINELS_ENV} must list host:port entries separated by commas, got {part!r}"
            )
        addresses.append((host.strip("[]"), int(port)))
    if not addresses:
        raise BrokerConfigError(f"{SENTINELS_ENV} names no Sentinel: {spec!r}")
    return tuple(addresses), kwargs


def _min_replicas(value: str | None) -> int:
    if value is None or not value.strip():
        return DEFAULT_MIN_REPLICAS
    try:
        replicas = int(value)
    except ValueError:
        replicas = -1
    if replicas < 0:
        raise BrokerConfigError(f"{MIN_REPLICAS_ENV} must be 0 or more, got {value!r}")
    return replicas


def _db(value: str | None) -> int:
    if value is None or not value.strip():
        return 0
    if not value.strip().isdigit():
        raise BrokerConfigError(f"{DB_ENV} must be a database number, got {value!r}")
    return int(value)


def redact(url: str) -> str:
    """`url` without its password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()


# Touches the mark only if the guarded key exists on this server: WAIT then covers every
# write this server took before it, and a guard written to a master that failed over
# without passing it on is found missing instead of acknowledged.
_MARK = """
if KEYS[1] ~= '' and redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('INCR', KEYS[2])
return 1
"""


@dataclass(frozen=True)
class Replication:
    """Acknowledged means replicated: `WAIT min_replicas timeout_ms` after a write.
    Off (every call a no-op) without Sentinels or with `min_replicas` 0."""

    min_replicas: int = 0
    timeout_ms: int = ACK_TIMEOUT_MS

    @classmethod
    def of(cls, settings: BrokerSettings) -> Replication:
        return cls(settings.min_replicas if settings.uses_sentinel else 0)

    @property
    def on(self) -> bool:
        return self.min_replicas > 0

    def wait_in(self, pipe: Any) -> None:
        """Queue `WAIT` on `pipe` after its writes: the same connection, so it waits for
        exactly them. `check` reads the answer."""
        if self.on:
            pipe.execute_command("WAIT", self.min_replicas, self.timeout_ms)

    def check(self, acked: Any) -> None:
        if int(acked) < self.min_replicas:
            raise NotReplicated(int(acked), self.min_replicas)

    def confirm(self, conn: redis.Redis, guard: str = "") -> None:
        """Wait until every write this server took so far is on enough replicas; `guard`
        names a key the caller wrote, which must still be on the server WAIT runs on."""
        if not self.on:
            return
        with conn.pipeline(transaction=False) as pipe:
            pipe.eval(_MARK, 2, guard, keys.REPLICATION_MARK)
            self.wait_in(pipe)
            marked, acked = pipe.execute()
        if not marked:
            raise NotReplicated(0, self.min_replicas, guard)
        self.check(acked)


@dataclass(frozen=True)
class ReplicationState:
    """What `INFO replication` says of the server a client talks to (for /ready, /metrics,
    /admin/workers and the dashboard)."""

    master: str  # host:port this client reached
    role: str
    replicas: int  # connected replicas
    sentinel: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "master": self.master,
            "role": self.role,
            "replicas": self.replicas,
            "sentinel": self.sentinel,
        }


def replication_state(conn: redis.Redis) -> ReplicationState:
    """Read the master's replication role and replica count (one `INFO replication`; a
    server without INFO, such as the embedded fakeredis broker, says role "unknown")."""
    try:
        info = conn.info("replication")
    except redis.ResponseError:
        info = {"role": "unknown"}
    pool = conn.connection_pool
    address = ""
    if hasattr(pool, "get_master_address"):  # a Sentinel pool: the master it now follows
        master = getattr(pool, "master_address", None)
        address = f"{master[0]}:{master[1]}" if master else ""
        sentinel = True
    else:
        kwargs = pool.connection_kwargs
        address = f"{kwargs.get('host', '')}:{kwargs.get('port', '')}"
        if kwargs.get("path"):
            address = str(kwargs["path"])
        sentinel = False
    return ReplicationState(
        master=address,
        role=str(info.get("role", "")),
        replicas=int(info.get("connected_slaves", 0)),
        sentinel=sentinel,
    )


@dataclass(frozen=True)
class EventsSettings:
    """Where the token path's keys live (`keys.job_events`, `keys.job_lease`): on the queue
    Redis (no `nodes`, the default), or on a Redis Cluster whose startup nodes
    `LLMQ_EVENTS_CLUSTER` lists (`host:port,host:port`). One Redis core carries ~200,000
    tokens a second written and relayed (bench/fleet.py); a cluster spreads the jobs'
    streams over its shards by hash slot, while RQ's queues, the job records and everything
    else stay on the one Redis (or Sentinel master) RQ needs. `connect` gives the events
    client to workers and the API alike."""

    nodes: tuple[tuple[str, int], ...] = ()

    @property
    def clustered(self) -> bool:
        return bool(self.nodes)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EventsSettings:
        env = os.environ if environ is None else environ
        spec = env.get(EVENTS_CLUSTER_ENV, "").strip()
        if not spec:
            return cls()
        nodes = []
        for part in (p.strip() for p in spec.split(",")):
            host, sep, port = part.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise BrokerConfigError(
                    f"{EVENTS_CLUSTER_ENV} must list host:port entries separated by commas, "
                    f"got {part!r}"
                )
            nodes.append((host.strip("[]"), int(port)))
        return cls(tuple(nodes))

    def connect(self, queue: redis.Redis, **client_kwargs: Any) -> Any:
        """The events client: `queue` itself without a cluster, else a `RedisCluster` of
        the startup nodes (it learns the rest of the cluster and follows MOVED / failovers
        itself). `client_kwargs` (timeouts) are the caller's."""
        if not self.clustered:
            return queue
        client_kwargs.pop("retry", None)  # RedisCluster retries a moved slot itself
        client_kwargs.pop("health_check_interval", None)
        startup = [ClusterNode(host, port) for host, port in self.nodes]
        return RedisCluster(startup_nodes=startup, **client_kwargs)

    def env(self) -> dict[str, str]:
        """The variable that hands these settings to a child process (`llmq serve`)."""
        if not self.clustered:
            return {}
        return {EVENTS_CLUSTER_ENV: ",".join(f"{h}:{p}" for h, p in self.nodes)}

    def describe(self) -> str:
        if not self.clustered:
            return "on the queue Redis"
        return "cluster via " + ",".join(f"{h}:{p}" for h, p in self.nodes)
