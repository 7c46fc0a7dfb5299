"""What crosses Redis between the API and the workers, one module per noun (like rq's).

Shared by `api/` and `workers/`; imports only the standard library, pydantic (for the
documented response bodies), redis (`broker` builds every client) and `workers.keys`, never
the engine. Nothing here is ever
pickled: records are Redis hashes of strings, events are stream entries of JSON. Each
message has one encoder and one decoder: `JobRecord.to_hash` / `from_hash`, `events.encode`
/ `decode`, `commands.AdminCommand.encode` / `decode`.

| noun | module |
| --- | --- |
| TTLs, limits and intervals both sides rely on | `defaults` |
| job statuses, endpoints, the job record | `job` |
| a worker's published state | `worker_info` |
| admin commands for one worker | `commands` |
| queue wake tokens | `wake` |
| histogram fields kept in Redis hashes | `histograms` |
| a job's events (`StreamToken`, `StreamDone`, `StreamError`) and their codec | `events` |
| the OpenAI error body; `OpenAIError`, base of every error a client sees | `errors` |
| generation response bodies, the models `/openapi.json` documents | `bodies` |
| a Responses API response rendered from its job record (object, items, usage) | `responses_api` |
| prompt-prefix digests for cache-affinity routing | `prefix` |
| per-caller rate-limit buckets: their Lua, charge and settle | `rate_limit` |
| offline batches: statuses, file and batch records | `batches` |
| lines of a batch's output and error files | `batch_output` |
| bytes-or-str from Redis as str | `text` |
| where Redis is (URL or Sentinel), its clients, acknowledgements that wait on replicas | `broker` |
"""
