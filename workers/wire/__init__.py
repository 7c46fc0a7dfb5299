"""What crosses Redis between the API and the workers, one module per noun (like rq's).

Shared by `api/` and `workers/`; imports only the standard library and `workers.keys`.
Nothing here is ever pickled: records are Redis hashes of strings, events are stream entries
of JSON.

| noun | module |
| --- | --- |
| TTLs, limits and intervals both sides rely on | `defaults` |
| job statuses, endpoints, the job record | `job` |
| a worker's published state | `worker_info` |
| admin commands for one worker | `commands` |
| queue wake tokens | `wake` |
| histogram fields kept in Redis hashes | `histograms` |
| the event codec and the one writer of an unfenced terminal event | `events` |
| the OpenAI error body | `errors` |
| prompt-prefix digests for cache-affinity routing | `prefix` |
| offline batches: statuses, file and batch records | `batches` |
| lines of a batch's output and error files | `batch_output` |
| bytes-or-str from Redis as str | `text` |
"""
