"""What llmq relies on in rq and gunicorn beyond their documented APIs, checked against the
installed versions (pinned in pyproject.toml), so an upgrade that changes one of them fails
here, naming it, rather than somewhere in the fault suite.

rq: llmq's Lua (workers/scripts.py, api/store.py) reads and writes rq's Redis layout
directly: queues are lists of job ids under `rq:queue:<name>`, a job is a hash with a
`status` field, and the StartedJobRegistry holds `<job id>:<execution id>` members
(workers/recovery.py). The rq calls workers/rq_registries.py makes are public, but their
argument lists changed between rq versions, so they are pinned too.

redis-py: the worker's step writer (workers/event_writer.py) records its metrics commands on
a pipeline it never sends and reads them from `command_stack`, then sends them with its own
packing (workers/resp.py) on a connection taken from the client's pool.

gunicorn: api/gunicorn_worker.py subclasses gthread's `ThreadWorker` and uses its private
`_DEFER` verdict and its connection bookkeeping; gunicorn has no public API for deferring a
connection. api/gevent_worker.py (the default) uses the gevent worker's hooks.
"""

from __future__ import annotations

import inspect
import socket

import fakeredis
import pytest
import redis
from gunicorn.config import Config
from gunicorn.http import unreader
from gunicorn.workers import gthread
from rq import Queue
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry
from rq.results import Result
from rq.serializers import JSONSerializer
from rq.suspension import is_suspended
from rq.worker import BaseWorker


def params(function: object) -> list[str]:
    return list(inspect.signature(function).parameters)  # type: ignore[arg-type]


def has_params(function: object, *names: str) -> None:
    found = params(function)
    missing = [n for n in names if n not in found]
    where = getattr(function, "__qualname__", function)
    assert not missing, f"{where} lost parameter(s) {missing}; it takes {found}"


# ------------------------------------------------------------------------------ rq


@pytest.fixture
def conn() -> fakeredis.FakeRedis:
    return fakeredis.FakeRedis()


def test_rq_calls_keep_the_arguments_workers_rq_registries_passes():
    has_params(Execution.create, "job", "ttl", "pipeline", "worker_name")
    has_params(Execution.delete, "job", "pipeline")
    has_params(Execution.heartbeat, "started_job_registry", "ttl", "pipeline")
    for create in (Result.create, Result.create_failure):
        has_params(create, "job", "ttl", "worker_name", "pipeline", "execution_id")
        has_params(create, "execution_started_at", "execution_ended_at")
    has_params(Result.create, "type", "return_value")
    has_params(Result.create_failure, "exc_string")
    has_params(Job.save, "pipeline", "include_meta", "include_result")
    has_params(Job.cleanup, "ttl", "pipeline", "remove_from_queue")
    has_params(Job.set_status, "status", "pipeline")
    has_params(FailedJobRegistry.add, "job", "ttl", "exc_string", "pipeline")
    has_params(is_suspended, "connection", "worker")
    for name in (
        "increment_successful_job_count",
        "increment_failed_job_count",
        "increment_total_working_time",
        "set_current_job_id",
        "handle_payload",
        "register_birth",
        "teardown",
    ):
        assert callable(getattr(BaseWorker, name, None)), f"rq's BaseWorker lost {name}"
    assert isinstance(inspect.getattr_static(BaseWorker, "connection_timeout"), property), (
        "rq's BaseWorker.connection_timeout is no longer a property (workers/rq_registries.py)"
    )


def test_rq_redis_layout_the_lua_scripts_use(conn):
    queue = Queue("q", connection=conn, serializer=JSONSerializer)
    assert queue.key == "rq:queue:q", "rq renamed its queue keys (workers/scripts.py, _CLAIM)"
    assert Queue.redis_queues_keys == "rq:queues", "rq renamed its set of queues"
    job = queue.enqueue_call(func="workers.jobs.run_job", args=["j1"], job_id="j1")
    assert conn.type(queue.key) == b"list" and conn.lrange(queue.key, 0, -1) == [b"j1"], (
        "an rq queue is no longer a list of job ids (workers/scripts.py claims by LPOP)"
    )
    assert Job.key_for("j1") in (b"rq:job:j1", "rq:job:j1"), "rq renamed its job keys"
    assert conn.hget(job.key, "status") == JobStatus.QUEUED.value.encode(), (
        "an rq job hash no longer keeps its status in `status` (workers/scripts.py, _REQUEUE)"
    )
    with conn.pipeline() as pipe:
        execution = Execution.create(job, 60, pipe, "w")
        pipe.execute()
    members = conn.zrange(job.started_job_registry.key, 0, -1)
    assert members == [f"j1:{execution.id}".encode()], (
        "StartedJobRegistry members are no longer `<job id>:<execution id>` "
        f"(workers/recovery.py, clear_started): {members}"
    )
    assert conn.zrange(job.execution_registry.key, 0, -1) == [execution.id.encode()]
    assert Execution(execution.id, "j1", conn).key == f"rq:execution:j1:{execution.id}"


# ------------------------------------------------------------------------------ gunicorn


def test_gthread_still_defers_connections_the_way_api_gunicorn_worker_expects():
    assert hasattr(gthread, "_DEFER"), "gunicorn's gthread has no _DEFER (deferred connections)"
    finish = inspect.getsource(gthread.ThreadWorker.finish_request)
    for used in ("_DEFER", "pending_conns", "poller"):
        assert used in finish, f"gthread's finish_request no longer uses {used}"
    init = inspect.getsource(gthread.ThreadWorker.__init__)
    for attribute in ("pending_conns", "nr_conns", "poller"):
        assert f"self.{attribute}" in init, f"gthread's ThreadWorker has no {attribute}"
    has_params(gthread.ThreadWorker.handle, "conn")
    has_params(gthread.ThreadWorker.finish_request, "conn", "fs")
    has_params(gthread.ThreadWorker.enqueue_req, "conn")
    assert params(gthread.ThreadWorker.murder_pending) == ["self"]


def test_gthread_connections_have_what_api_gunicorn_worker_reads():
    left, right = socket.socketpair()
    try:
        conn = gthread.TConn(Config(), left, ("127.0.0.1", 1), None)
        for attribute in ("sock", "client", "parser", "timeout"):
            assert hasattr(conn, attribute), f"gthread's TConn has no {attribute}"
        assert callable(conn.init), "gthread's TConn has no init()"
    finally:
        left.close()
        right.close()
    reader = unreader.Unreader()
    assert hasattr(reader, "buf"), "gunicorn's Unreader has no buf"
    assert callable(reader.take_buffered) and callable(reader.unread)


def test_gunicorn_http2_negotiation_is_where_the_worker_looks():
    from gunicorn.http2 import negotiation

    has_params(negotiation.prior_knowledge_allowed, "cfg", "peer_addr")


def test_a_redis_py_pipeline_records_commands_where_the_step_writer_reads_them():
    pipe = redis.Redis(port=1).pipeline(transaction=False)  # nothing is sent: no server
    pipe.hincrby("h", "f", 2)
    pipe.set("k", "v", ex=5)
    assert [args for args, _ in pipe.command_stack] == [
        ("HINCRBY", "h", "f", 2),
        ("SET", "k", "v", "EX", 5),
    ]
    pool = redis.ConnectionPool(port=1)
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [
        p.name
        for p in inspect.signature(pool.get_connection).parameters.values()
        if p.kind in positional and p.default is inspect.Parameter.empty
    ]
    assert required == [], f"ConnectionPool.get_connection now needs {required}"
    has_params(pool.release, "connection")
    has_params(redis.Connection.send_packed_command, "command")
    has_params(redis.Connection.read_response, "disable_decoding")


def test_gevent_worker_hooks_are_where_api_gevent_worker_expects():
    """api/gevent_worker.py: the header deadline is `timeout_ctx` around the parser in
    AsyncWorker's keep-alive loop; the body is a `LengthReader` on the request's `Body`."""
    from gunicorn.http.body import Body, LengthReader
    from gunicorn.workers import base_async, ggevent

    handle = inspect.getsource(base_async.AsyncWorker.handle)
    assert "with self.timeout_ctx():" in handle, "AsyncWorker no longer bounds next(parser)"
    assert "except StopIteration" in handle, "AsyncWorker no longer ends on StopIteration"
    has_params(ggevent.GeventWorker.handle_request, "listener_name", "req", "sock", "addr")
    has_params(ggevent.GeventWorker.handle, "listener", "client", "addr")
    reader = LengthReader(unreader.Unreader(), 3)
    assert reader.length == 3, "gunicorn's LengthReader has no length"
    assert Body(reader).reader is reader, "gunicorn's Body no longer keeps its reader"
