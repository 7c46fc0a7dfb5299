"""A stand-in worker for API tests: a thread with a scripted engine and the worker's writes.

It registers itself like a real worker (keys.WORKERS, a WorkerInfo hash, keys.MODELS),
claims job ids from the models' RQ queues with the worker's own `Claims` and `Leases`, reads
each job's record and generation spec, and writes token events and a terminal event through
the worker's own `EventWriter` (every write fenced by the job's lease), honouring the cancel
flag between tokens. What it generates is scripted by the prompt text (the last
message's content for chat):

- tokens are "t0 ", "t1 ", ... (`max_tokens` of them, or 8 when unset);
- "slow" in the prompt waits `slow_delay` seconds per token;
- "toolong" in the prompt fails the job with a 400, like a prompt beyond the context;
- "crash" in the prompt fails it with a 500;
- "callfn" in a chat prompt whose request has tools answers with one call of the first
  tool, `{"city": "Paris"}`, as tool-call deltas (`workers.wire.events`) and `tool_calls`.
"""

from __future__ import annotations

import base64
import json
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis

from runtime.request import GenerationSpec
from workers import keys
from workers.claims import CANCELLED as CLAIMED_CANCELLED
from workers.claims import Claims
from workers.event_store import RedisEvents
from workers.event_writer import EventWriter
from workers.jobs import ActiveJob
from workers.leases import Leases
from workers.wire.errors import cancelled_error, error_body
from workers.wire.events import token_event
from workers.wire.job import (
    CANCELLED,
    CHAT_COMPLETIONS,
    COMPLETIONS,
    FAILED,
    STARTED,
    TERMINAL_STATUSES,
    JobRecord,
    response_id,
)
from workers.wire.worker_info import READY, WorkerInfo

LEASE_MS = 60_000


class FakeWorker:
    def __init__(
        self,
        conn: redis.Redis,
        name: str = "fake-1",
        models: tuple[str, ...] = ("tiny",),
        context_length: int = 2048,
        slow_delay: float = 0.05,
    ) -> None:
        self.conn = conn
        # its models loaded, as a real worker's are once its start-up loads end (/ready)
        pool = {m: {"state": READY, "memory_mb": 1.0, "in_flight": 0} for m in models}
        self.info = WorkerInfo(name=name, pid=1234, host="test", models=list(models), pool=pool)
        self.context_length = context_length
        self.slow_delay = slow_delay
        self.paused = threading.Event()  # set: registered and alive, but takes no jobs
        self.processed: list[str] = []
        self.events = RedisEvents(conn)  # the token path's mode, chosen once here
        self.leases = Leases(self.events, name, LEASE_MS / 1000)
        self.claims = Claims(conn, self.leases, self.events)
        self.writer = EventWriter(conn, name, set(), self.events)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ lifecycle

    def register(self) -> FakeWorker:
        for model in self.info.models:
            self.conn.hset(keys.MODELS, model, json.dumps({"context_length": self.context_length}))
        self.conn.sadd(keys.WORKERS, self.info.name)
        self._heartbeat()
        return self

    def _heartbeat(self) -> None:
        self.info.heartbeat = time.time()
        self.conn.hset(keys.worker(self.info.name), mapping=self.info.to_hash())

    def start(self) -> FakeWorker:
        self.register()
        self._thread = threading.Thread(target=self._run, name=self.info.name, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        served = [(m, kind) for m in self.info.models for kind in keys.QUEUE_KINDS]
        queues = [f"rq:queue:{keys.queue_name(m, kind)}" for m, kind in served]
        ranks = [keys.QUEUE_KINDS.index(kind) for _, kind in served]
        last_beat = time.monotonic()
        while not self._stop.is_set():
            if time.monotonic() - last_beat > 1:
                self._heartbeat()
                last_beat = time.monotonic()
            claimed = None if self.paused.is_set() else self._claim(queues, ranks)
            if claimed is None:
                time.sleep(0.01)
                continue
            job_id, attempt = claimed
            self.processed.append(job_id)
            self._execute(job_id, attempt)

    def _claim(self, queues: list[str], ranks: list[int]) -> tuple[str, int] | None:
        """The real worker's claim (`workers.claims`): pop, count the attempt, lease."""
        claim = self.claims.take(queues, ranks)
        if claim is None:
            return None
        if claim.attempt == CLAIMED_CANCELLED:  # never ran, no lease: as the worker does
            self.writer.cancel_unclaimed(claim.job_id)
            return None
        return (claim.job_id, claim.attempt) if claim.attempt > 0 else None

    # ------------------------------------------------------------ one job

    def process(self, job_id: str) -> None:
        """Run one job a test took off its queue itself, claimed by the same script (put on
        a private list for it to pop)."""
        hand = f"{keys.PREFIX}:test:hand:{self.info.name}"
        self.conn.rpush(hand, job_id)
        claimed = self._claim([hand], [0])
        if claimed is not None:
            self._execute(*claimed)

    def _execute(self, job_id: str, attempt: int) -> None:
        """Scripted tokens written as the worker writes a step (`EventWriter.flush`), and
        its end as the worker ends a job (`flush` with a result, or `EventWriter.end`)."""
        record = JobRecord.from_hash(self.conn.hgetall(keys.job(job_id)))
        if record.status in TERMINAL_STATUSES:  # ended by an earlier run: as the worker does
            self.conn.srem(keys.RUNNING, job_id)
            self.conn.delete(keys.job_lease(job_id))
            return
        job = _ScriptedJob(record, attempt, self.leases.name(attempt), None, None)
        job.written = self.conn.xlen(keys.job_events(job_id))
        with self.conn.pipeline() as pipe:  # as the worker starts a job
            pipe.hset(keys.job(job_id), mapping={"status": STARTED, "worker": self.info.name})
            pipe.hsetnx(keys.job(job_id), "started_at", time.time())
            pipe.execute()
        prompt = self._prompt_text(record)
        if "toolong" in prompt:
            error = error_body(
                f"This model's maximum context length is {self.context_length} tokens.",
                param="prompt",
                status=400,
            )
            self._end(job, FAILED, error)
            return
        if "crash" in prompt:
            crashed = error_body("The engine failed.", type_="server_error", status=500)
            self._end(job, FAILED, crashed)
            return
        if record.endpoint not in (COMPLETIONS, CHAT_COMPLETIONS):
            job.result = self._embeddings(record)
            self._flush(job)
            return
        if "callfn" in prompt and record.request.get("tools"):
            self._call_tool(job, record, attempt)
            return
        spec = GenerationSpec.from_record(record.spec or {})
        count = spec.max_tokens or 8
        choices = spec.n * len(spec.prompts or [None])
        delay = self.slow_delay if "slow" in prompt else 0.0
        texts = [""] * choices
        for i in range(count):
            if self.conn.exists(keys.job_cancel(job_id)):
                self._end(job, CANCELLED, cancelled_error())
                return
            for c in range(choices):
                text = f"t{i} "
                texts[c] += text
                entry = None
                if spec.logprobs is not None:
                    entry = self._logprobs_entry(record, text, len(texts[c]) - 3)
                finish = "length" if i == count - 1 else None
                event = token_event(c, i, text, 100 + i, -0.5, finish, attempt, entry)
                job.pending.append(event)
            job.tokens = i + 1
            self._flush(job)
            if delay:
                time.sleep(delay)
        job.result = self._result(record, texts, count)
        self._flush(job)

    def _call_tool(self, job: _ScriptedJob, record: JobRecord, attempt: int) -> None:
        """A call of the request's first tool, streamed as the worker streams one."""
        name = record.request["tools"][0]["function"]["name"]
        call_id = f"call_{record.id[-8:]}"
        first = {"index": 0, "id": call_id, "type": "function"}
        deltas = [
            {"tool_calls": [{**first, "function": {"name": name, "arguments": ""}}]},
            {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
            {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
        ]
        for i, delta in enumerate(deltas):
            finish = "tool_calls" if i == len(deltas) - 1 else None
            event = token_event(0, i, "x", 100 + i, None, finish, attempt, None, None, delta)
            job.pending.append(event)
        job.tokens = len(deltas)
        self._flush(job)
        job.result = self._result(record, [""], len(deltas))
        call = {**first, "function": {"name": name, "arguments": '{"city": "Paris"}'}}
        call.pop("index")
        choice = job.result["choices"][0]
        choice["message"] = {"role": "assistant", "content": None, "tool_calls": [call]}
        choice["finish_reason"] = "tool_calls"
        self._flush(job)

    def _flush(self, job: _ScriptedJob) -> None:
        """One step's writes for `job` (the cancel flag is checked before each token)."""
        if self.writer.flush([job], step_sizes=None).lost:
            raise RuntimeError(f"job {job.id}: the fake worker lost its lease")

    def _end(self, job: _ScriptedJob, status: str, body: dict[str, Any]) -> None:
        if not self.writer.end(job, status, body):
            raise RuntimeError(f"job {job.id}: the fake worker lost its lease")

    @staticmethod
    def _logprobs_entry(record: JobRecord, text: str, offset: int) -> dict[str, Any]:
        """One token's entry in the endpoint's own layout, as workers.wire.events specifies."""
        if record.endpoint == CHAT_COMPLETIONS:
            top = [{"token": "x", "logprob": -1.5, "bytes": [120]}]
            return {
                "token": text,
                "logprob": -0.5,
                "bytes": list(text.encode()),
                "top_logprobs": top,
            }
        return {"token": text, "logprob": -0.5, "top_logprobs": {"x": -1.5}, "text_offset": offset}

    @staticmethod
    def _prompt_text(record: JobRecord) -> str:
        """The prompt as the script reads it (the body: embeddings have no spec)."""
        req = record.request
        if record.endpoint == CHAT_COMPLETIONS:
            return req["messages"][-1].get("content") or ""  # none: a turn of tool calls
        value = req.get("prompt", req.get("input", ""))
        return value if isinstance(value, str) else json.dumps(value)  # texts or token ids

    def _result(self, record: JobRecord, texts: list[str], count: int) -> dict[str, Any]:
        chat = record.endpoint == CHAT_COMPLETIONS
        usage = {
            "prompt_tokens": 5,
            "completion_tokens": count * len(texts),
            "total_tokens": 5 + count * len(texts),
        }
        if chat:
            choices = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": t},
                    "logprobs": None,
                    "finish_reason": "length",
                }
                for i, t in enumerate(texts)
            ]
        else:
            choices = [
                {"index": i, "text": t, "logprobs": None, "finish_reason": "length"}
                for i, t in enumerate(texts)
            ]
        return {
            "id": response_id(record.endpoint, record.id),
            "object": "chat.completion" if chat else "text_completion",
            "created": int(record.created_at),
            "model": record.responds_as,  # as the worker: `ActiveJob.body`
            "choices": choices,
            "usage": usage,
        }

    @staticmethod
    def _embeddings(record: JobRecord) -> dict[str, Any]:
        inputs = record.request["input"]
        inputs = [inputs] if isinstance(inputs, str) else inputs
        vector: Any = [0.6, 0.8, 0.0]
        if record.request.get("encoding_format") == "base64":
            vector = base64.b64encode(struct.pack("<3f", *vector)).decode()
        data = [
            {"object": "embedding", "index": i, "embedding": vector} for i in range(len(inputs))
        ]
        usage = {"prompt_tokens": len(inputs), "total_tokens": len(inputs)}
        return {"object": "list", "data": data, "model": record.model, "usage": usage}


@dataclass(eq=False)
class _ScriptedJob(ActiveJob):
    """An `ActiveJob` without an engine: its completion tokens are the script's count."""

    tokens: int = 0

    @property
    def completion_tokens(self) -> int:
        return self.tokens
