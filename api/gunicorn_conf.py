"""Gunicorn settings for the API: `gunicorn -c api/gunicorn_conf.py 'api.app:create_app()'`.

Greenlets, not threads, carry the load: most requests wait on a job (a sync completion or
an SSE stream lasts the whole generation), so each process runs gevent
(api/gevent_worker.py) and holds thousands of connections, while every waiting request's
events come from the process's one stream reader (api/streams/stream_hub.py) over a bounded pool of
Redis connections (LLMQ_API_REDIS_CONNECTIONS). `LLMQ_API_WORKER_CLASS=gthread` runs the
previous thread pool (api/gunicorn_worker.py, LLMQ_API_THREADS threads). `timeout` is the
heartbeat of a process's main loop, not a request limit, so long streams are not killed by
it; idle keep-alive sockets and slow request headers are.
"""

from __future__ import annotations

import os

bind = f"{os.environ.get('HOST', '127.0.0.1')}:{os.environ.get('PORT', '8000')}"
workers = int(os.environ.get("LLMQ_API_WORKERS", "2"))
WORKER_CLASSES = {
    "gevent": "api.gevent_worker.StreamingWorker",  # a connection is a greenlet
    "gthread": "api.gunicorn_worker.HeaderDeadlineWorker",  # a connection holds a thread
}
worker_class = WORKER_CLASSES[os.environ.get("LLMQ_API_WORKER_CLASS", "gevent")]
threads = int(os.environ.get("LLMQ_API_THREADS", "32"))  # gthread only
# open sockets per process, idle keep-alive ones included (gevent: also the open streams);
# each needs a file descriptor, so the process raises its soft limit (post_worker_init)
worker_connections = int(os.environ.get("LLMQ_API_CONNECTIONS", "10000"))

timeout = 120  # a process whose main loop stalls this long is restarted
graceful_timeout = 30  # on SIGTERM, streams in flight get this long to end
keepalive = 5  # idle keep-alive connections are closed after 5 s

# Request-line and header limits against oversized headers; slow ones are the worker
# class's business (headers complete within LLMQ_HEADER_TIMEOUT, default 10 s).
limit_request_line = 8190
limit_request_fields = 100
limit_request_field_size = 8190

accesslog = "-"  # URLs carry no prompt text; bodies are never logged
# gunicorn's default line plus the time spent in the app (%(M)s ms: from the parsed request
# to the response's end; a stream's whole length, a submission's own latency)
access_log_format = '%(h)s %(l)s %(u)s %(t)s "%(r)s" %(s)s %(b)s "%(f)s" "%(a)s" %(M)sms'
errorlog = "-"
loglevel = os.environ.get("LLMQ_LOG_LEVEL", "info")


def post_worker_init(worker: object) -> None:
    """Raise the soft limit on open files as far as the hard one allows: each stream is a
    socket, and the common soft limit (1024) is far below `worker_connections`."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = worker_connections + 256  # the Redis pool, logs, the listener
    if hard != resource.RLIM_INFINITY:
        wanted = min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    quiet_collector()


# Python's cyclic collector stops every greenlet of the process while it runs. Under
# `make test-load` (2,000 streams, 2 saturated cores) each process ran a full collection
# every ~7 s, 125-310 ms each: the API's p99 (365-388 ms). Objects that live as long as the
# process (the app, its modules) are frozen out of every collection once loaded, and the
# young generation is collected after 10,000 allocations instead of 700, so full ones come
# ~14x less often (a request's garbage is freed by reference counting either way): none
# in the 60 s of load after it, and the API's p99 265 ms
# (bench/log/2026-11-27-seventh-session-zen4-epyc.md).
GC_YOUNG_THRESHOLD = 10_000


def quiet_collector() -> None:
    """Once the app is loaded (`post_worker_init`): see above."""
    import gc

    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)


def post_fork(server: object, worker: object) -> None:
    """Each API process in a session of its own. Where the kernel groups processes by
    session for CPU shares (Linux's autogroups, on by default on many distributions), a
    session's processes share one group's share: two API processes beside `llmq serve`'s
    workers (each in a session of its own, workers/supervisor.py) got as much CPU together
    as one worker, and on saturated cores every request waited for its turn in them."""
    os.setsid()
