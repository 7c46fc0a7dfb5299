"""llmq's HTTP API (Flask): OpenAI-compatible endpoints and async jobs over Redis queues.

Imports only workers.keys and workers.wire from the rest of llmq, never the engine.
"""
