"""A stand-in worker for API tests: a thread that follows `workers.wire` to the letter.

It registers itself like a real worker (keys.WORKERS, a WorkerInfo hash, keys.MODELS),
takes job ids from the models' RQ queues, reads each job record and writes token events and
a terminal event to the job's stream, honouring the cancel flag between tokens. What it
generates is scripted by the prompt text (the last message's content for chat):

- tokens are "t0 ", "t1 ", ... (`max_tokens` of them, or 8 when unset);
- "slow" in the prompt waits `slow_delay` seconds per token;
- "toolong" in the prompt fails the job with a 400, like a prompt beyond the context;
- "crash" in the prompt fails it with a 500.
"""

from __future__ import annotations

import base64
import json
import struct
import threading
import time
from typing import Any

import redis

from workers import keys
from workers.wire.defaults import JOB_TTL_SECONDS
from workers.wire.errors import cancelled_error, error_body
from workers.wire.events import event_fields, token_event, write_ending
from workers.wire.job import (
    CANCELLED,
    CHAT_COMPLETIONS,
    COMPLETIONS,
    FAILED,
    FINISHED,
    STARTED,
    JobRecord,
    response_id,
)
from workers.wire.worker_info import READY, WorkerInfo


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
        queues = [
            f"rq:queue:{keys.queue_name(m, kind)}"
            for m in self.info.models
            for kind in keys.QUEUE_KINDS
        ]
        last_beat = time.monotonic()
        while not self._stop.is_set():
            if time.monotonic() - last_beat > 1:
                self._heartbeat()
                last_beat = time.monotonic()
            if self.paused.is_set():
                time.sleep(0.01)
                continue
            popped = self.conn.blpop(queues, timeout=0.1)
            if popped is None:
                continue
            if self.paused.is_set():  # paused while blocked in BLPOP: put it back in front
                self.conn.lpush(popped[0], popped[1])
                continue
            job_id = popped[1].decode()
            self.processed.append(job_id)
            self.process(job_id)

    # ------------------------------------------------------------ one job

    def process(self, job_id: str) -> None:
        record = JobRecord.from_hash(self.conn.hgetall(keys.job(job_id)))
        if self.conn.exists(keys.job_cancel(job_id)):
            self._finish(record, CANCELLED, cancelled_error())
            return
        self.conn.hset(
            keys.job(job_id),
            mapping={
                "status": STARTED,
                "started_at": str(time.time()),
                "attempts": "1",
                "worker": self.info.name,
            },
        )
        req = record.request
        prompt = self._prompt_text(record)
        if "toolong" in prompt:
            error = error_body(
                f"This model's maximum context length is {self.context_length} tokens.",
                param="prompt",
                status=400,
            )
            self._finish(record, FAILED, error)
            return
        if "crash" in prompt:
            error = error_body("The engine failed.", type_="server_error", status=500)
            self._finish(record, FAILED, error)
            return
        if record.endpoint not in (COMPLETIONS, CHAT_COMPLETIONS):
            self._finish(record, FINISHED, self._embeddings(record))
            return
        count = req.get("max_tokens") or 8
        choices = req.get("n", 1) * (
            len(req["prompt"]) if isinstance(req.get("prompt"), list) else 1
        )
        delay = self.slow_delay if "slow" in prompt else 0.0
        texts = [""] * choices
        logprobs = (
            req.get("logprobs")
            if record.endpoint == COMPLETIONS
            else (req.get("top_logprobs", 0) if req.get("logprobs") else None)
        )
        for i in range(count):
            if self.conn.exists(keys.job_cancel(job_id)):
                self._finish(record, CANCELLED, cancelled_error())
                return
            pipe = self.conn.pipeline()
            for c in range(choices):
                text = f"t{i} "
                texts[c] += text
                entry = None
                if logprobs is not None:
                    entry = self._logprobs_entry(record, text, len(texts[c]) - 3)
                finish = "length" if i == count - 1 else None
                event = token_event(c, i, text, 100 + i, -0.5, finish, 1, entry)
                pipe.xadd(keys.job_events(job_id), event_fields(event))
            pipe.expire(keys.job_events(job_id), JOB_TTL_SECONDS)
            pipe.hset(keys.job(job_id), "completion_tokens", str(i + 1))
            pipe.execute()
            if delay:
                time.sleep(delay)
        self._finish(record, FINISHED, self._result(record, texts, count))

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
        req = record.request
        if record.endpoint == CHAT_COMPLETIONS:
            return req["messages"][-1]["content"]
        value = req.get("prompt", req.get("input", ""))
        return value if isinstance(value, str) else " ".join(value)

    def _finish(self, record: JobRecord, status: str, data: dict[str, Any]) -> None:
        pipe = self.conn.pipeline()
        write_ending(pipe, record.id, status, data)
        pipe.execute()

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
            "model": record.model,
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
