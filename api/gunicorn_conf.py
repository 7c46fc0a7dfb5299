"""Gunicorn settings for the API: `gunicorn -c api/gunicorn_conf.py 'api.app:create_app()'`.

Threads, not processes, carry the load: most requests wait on Redis (a sync completion or
an SSE stream holds its thread for the whole generation), so each process runs a gthread
pool. `timeout` is the heartbeat of a process's main loop, not a request limit, so long
streams are not killed by it; idle keep-alive sockets and slow request headers are.
"""

from __future__ import annotations

import os

bind = f"{os.environ.get('HOST', '127.0.0.1')}:{os.environ.get('PORT', '8000')}"
workers = int(os.environ.get("LLMQ_API_WORKERS", "2"))
worker_class = "api.gunicorn_worker.HeaderDeadlineWorker"  # gthread, slow-loris safe
threads = int(os.environ.get("LLMQ_API_THREADS", "32"))
worker_connections = 1000  # open sockets per process, idle keep-alive ones included

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
