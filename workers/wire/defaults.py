"""Every TTL, interval and size limit that the API and the workers both rely on (rq's
`defaults.py` habit): documented constants, one home each."""

from __future__ import annotations

# jobs
JOB_TTL_SECONDS = 24 * 3600  # job record and event stream, which hold prompt and output text
LEASE_TTL_SECONDS = 10  # a running job's lease; renewed every LEASE_RENEW_SECONDS
LEASE_RENEW_SECONDS = 2
CANCEL_FLAG_TTL_SECONDS = 3600  # keys.job_cancel lives this long once set
MAX_ATTEMPTS = 5  # a job whose workers keep dying with it is failed, not retried forever

# workers
WORKER_HEARTBEAT_SECONDS = 5  # a worker rewrites its hash this often ...
WORKER_TTL_SECONDS = 15  # ... with this TTL; a missing or stale hash means a dead worker

# the dashboard's charts (`workers.history`, `api.history`)
HISTORY_SAMPLE_SECONDS = 5  # one sample of the shared metrics per this long, whoever takes it
HISTORY_SECONDS = 15 * 60  # ... and this much of them kept (a bounded stream)
HISTORY_TTFT_WINDOW_SECONDS = 60  # each point's TTFT p50/p95 are over the minute before it

# queue wake-ups
WAKE_MAX_TOKENS = 4  # a queue's wake list keeps this many; more would only wake idle workers
WAKE_TTL_SECONDS = 30  # ... for nothing, and a list nobody pops (its worker died) vanishes

# prefix-cache affinity
AFFINITY_TTL_SECONDS = 600  # a keys.affinity entry; a worker's prefix cache may evict sooner
AFFINITY_MAX_QUEUED = 4  # jobs waiting in one worker's own queue before the rest go shared
PREFIX_DIGEST_CHARS = 1000  # of a prompt's head that another prompt may share ...
PREFIX_DIGEST_MIN_CHARS = 200  # ... and below which routing for a cache hit does not pay

# offline batches and files
MAX_FILE_BYTES = 100 * 1024 * 1024  # one upload; Redis keeps it in memory, so not OpenAI's 200 MB
MAX_BATCH_LINES = 50_000  # requests in one input file (OpenAI's limit)
MAX_LINE_BYTES = 1024 * 1024  # one request line: the live API's body limit
FILE_TTL_SECONDS = 3 * 24 * 3600  # files hold prompt or output text: kept 3 days at most
MAX_COMPLETION_WINDOW_SECONDS = 24 * 3600
