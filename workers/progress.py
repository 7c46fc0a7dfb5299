"""A job's event stream as the worker sees it: what to append, and what was already sent.

The stream is the job's durable output log. A worker that takes over a job reads it to learn
which tokens each choice already streamed (docs/faults.md L1: the worker that resumes a job
learns from the Stream what was already sent) and continues after the last one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workers import keys
from workers.wire.events import StreamToken, decode, is_terminal
from workers.wire.text import as_str

READ_PAGE = 1000


@dataclass
class StreamedChoice:
    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class StreamProgress:
    choices: dict[int, StreamedChoice] = field(default_factory=dict)
    terminal: str | None = None  # the terminal event's kind once the job has ended
    length: int = 0  # entries in the stream (the next write is fenced on it)

    @property
    def tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices.values())


def read_progress(client: Any, job_id: str) -> StreamProgress:
    """Every token event already in the job's stream, by choice, in index order."""
    progress = StreamProgress()
    start = "-"
    while True:
        page = client.xrange(keys.job_events(job_id), min=start, count=READ_PAGE)
        for _, fields in page:
            progress.length += 1
            event = decode(fields)
            if is_terminal(event):
                progress.terminal = event.kind
            elif isinstance(event, StreamToken):
                choice = progress.choices.setdefault(event.choice, StreamedChoice())
                if event.index != len(choice.token_ids):
                    continue  # never expected (writes are fenced); keep the first copy
                choice.token_ids.append(event.token_id)
                choice.texts.append(event.text)
                if event.logprobs is not None:
                    choice.logprobs.append(event.logprobs)
                choice.finish_reason = event.finish_reason
        if len(page) < READ_PAGE:
            return progress
        start = "(" + as_str(page[-1][0])
