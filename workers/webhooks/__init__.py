"""Webhooks, the worker side: `llmq webhooks` turns the outbox into signed deliveries.

| module | what it holds |
| --- | --- |
| `process.py` | `llmq webhooks`: the dispatcher's thread beside `WebhookWorker` (RQ's) |
| `dispatcher.py` | `Dispatcher`: outbox entries -> one RQ delivery job per subscribed endpoint |
| `delivery.py` | `deliver`, the RQ job: the SSRF check, the Standard Webhooks signature, one POST |
| `reaper.py` | `Presence` (a process's lease) and `Reaper` (taking over a dead process's work) |

What crosses Redis, and so is shared with the API, stays in `workers/wire/` (the rule of
docs/architecture.md: `api/` imports only `workers.keys` and `workers.wire`):
`workers/wire/webhooks.py` (which jobs notify, the outbox entry, the event types and bodies,
the endpoints and their delivery logs) and `workers/wire/webhook_jobs.py` (the delivery
settings, the RQ queue and its dead-letter list). Nothing here is imported by `api/`; the
terminal writes that append outbox entries (`workers/scripts.py`, `workers/cluster_step.py`,
`wire.events.write_ending`) import only `workers/wire/webhooks.py`.
"""
