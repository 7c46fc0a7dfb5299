"""Offline batches (OpenAI's Batch API): their statuses and the file and batch records.

A batch (OpenAI's Batch API) is validated by the API when it is created: each valid line
of its input file is stored under `keys.batch_requests`, each invalid one goes straight
to `keys.batch_errors`. From then on the batch driver (`workers.batches`, run by any
worker under `keys.BATCHES_LOCK`) moves it on: validating -> in_progress (lines fed as
jobs of kind `batch`, a bounded number queued at a time) -> finalizing -> completed; or
cancelling -> cancelled, or expired once `expires_at` passes. Every valid line ends in
exactly one of `keys.batch_output` / `keys.batch_errors`, keyed by its line number.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from workers.wire.bodies import Batch, BatchUsage, FileObject, RequestCounts
from workers.wire.text import optional_float, optional_int, text_hash

BATCH_VALIDATING, BATCH_IN_PROGRESS, BATCH_FINALIZING = "validating", "in_progress", "finalizing"
BATCH_COMPLETED, BATCH_FAILED, BATCH_EXPIRED = "completed", "failed", "expired"
BATCH_CANCELLING, BATCH_CANCELLED = "cancelling", "cancelled"
BATCH_TERMINAL = frozenset({BATCH_COMPLETED, BATCH_FAILED, BATCH_EXPIRED, BATCH_CANCELLED})

FILE_PURPOSE_BATCH, FILE_PURPOSE_OUTPUT = "batch", "batch_output"


@dataclass
class FileRecord:
    """A file as stored in `keys.file(id)` (its bytes are in `keys.file_content(id)`)."""

    id: str
    bytes: int
    filename: str
    purpose: str
    created_at: float = field(default_factory=time.time)
    expires_at: float | None = None
    owner: str | None = None  # digest of the API key that created it (or its batch)

    def to_hash(self) -> dict[str, str]:
        return {k: str(v) for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_hash(cls, raw: dict[bytes | str, bytes | str]) -> FileRecord:
        h = text_hash(raw)
        return cls(
            id=h["id"],
            bytes=int(h["bytes"]),
            filename=h.get("filename", ""),
            purpose=h["purpose"],
            created_at=float(h["created_at"]),
            expires_at=optional_float(h.get("expires_at")),
            owner=h.get("owner"),
        )

    def to_body(self) -> FileObject:
        """OpenAI's file object."""
        return FileObject(
            id=self.id,
            object="file",
            bytes=self.bytes,
            created_at=int(self.created_at),
            expires_at=optional_int(self.expires_at),
            filename=self.filename,
            purpose=self.purpose,
            status="processed",
            status_details=None,
        )


_BATCH_TIMES = (
    "in_progress_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)
_BATCH_COUNTS = ("total", "completed", "failed", "valid", "fed")
_BATCH_TOKENS = ("input_tokens", "cached_tokens", "output_tokens", "reasoning_tokens")


@dataclass
class BatchRecord:
    """A batch as stored in `keys.batch(id)`. `valid` lines run as jobs; `fed` of them
    (in `keys.batch_lines` order) have been enqueued. `completed` / `failed` and the token
    counts are incremented in Redis as lines are collected. `ending` is "expired" once
    the driver is winding an overdue batch down."""

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    expires_at: float
    created_at: float = field(default_factory=time.time)
    status: str = BATCH_VALIDATING
    model: str | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: float | None = None
    finalizing_at: float | None = None
    completed_at: float | None = None
    failed_at: float | None = None
    expired_at: float | None = None
    cancelling_at: float | None = None
    cancelled_at: float | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0
    valid: int = 0
    fed: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0  # of the output tokens, those inside thinking
    metadata: dict[str, str] | None = None
    errors: list[dict[str, Any]] | None = None
    ending: str | None = None
    owner: str | None = None  # digest of the API key that created it; its jobs and files inherit it

    def to_hash(self) -> dict[str, str]:
        out = {}
        for name, value in asdict(self).items():
            if value is None:
                continue
            out[name] = json.dumps(value) if isinstance(value, dict | list) else str(value)
        return out

    @classmethod
    def from_hash(cls, raw: dict[bytes | str, bytes | str]) -> BatchRecord:
        h = text_hash(raw)
        record = cls(
            id=h["id"],
            endpoint=h["endpoint"],
            input_file_id=h["input_file_id"],
            completion_window=h["completion_window"],
            expires_at=float(h["expires_at"]),
            created_at=float(h["created_at"]),
            status=h.get("status", BATCH_VALIDATING),
            model=h.get("model"),
            output_file_id=h.get("output_file_id"),
            error_file_id=h.get("error_file_id"),
            metadata=json.loads(h["metadata"]) if "metadata" in h else None,
            errors=json.loads(h["errors"]) if "errors" in h else None,
            ending=h.get("ending"),
            owner=h.get("owner"),
        )
        for name in _BATCH_TIMES:
            setattr(record, name, optional_float(h.get(name)))
        for name in _BATCH_COUNTS + _BATCH_TOKENS:
            setattr(record, name, int(h.get(name, 0)))
        return record

    def to_body(self) -> Batch:
        """OpenAI's batch object."""
        return Batch(
            id=self.id,
            object="batch",
            endpoint=self.endpoint,
            model=self.model,
            errors={"object": "list", "data": self.errors} if self.errors else None,
            input_file_id=self.input_file_id,
            completion_window=self.completion_window,
            status=self.status,
            output_file_id=self.output_file_id,
            error_file_id=self.error_file_id,
            created_at=int(self.created_at),
            expires_at=int(self.expires_at),
            # the model's field order places them, whatever the order here
            **{name: optional_int(getattr(self, name)) for name in _BATCH_TIMES},
            request_counts=RequestCounts(
                total=self.total, completed=self.completed, failed=self.failed
            ),
            usage=BatchUsage(
                input_tokens=self.input_tokens,
                input_tokens_details={"cached_tokens": self.cached_tokens},
                output_tokens=self.output_tokens,
                output_tokens_details={"reasoning_tokens": self.reasoning_tokens},
                total_tokens=self.input_tokens + self.output_tokens,
            ),
            metadata=self.metadata,
        )
