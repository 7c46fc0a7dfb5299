"""llmq's front door: the `llmq` command, above the three rooms it dispatches to.

`runtime/` (the engine), `workers/` (job execution) and `api/` (HTTP) each add their own
subcommands; this package only collects them, so every import here points down.
"""
