"""One job while a worker runs it: its choices, what they produced, and its result body.

`ActiveJob` knows nothing of Redis: the worker hands it the record, the RQ job and the
stream progress of earlier attempts, feeds it engine events, and writes out the events it
queues in `pending`. `run_job` is the one function name RQ jobs may carry (the allowlist in
`workers.wire.job.JOB_FUNCTION`); llmq workers never call it, they run jobs in batches.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

from rq.job import Job
from rq.queue import Queue

from runtime.answer_parser import AnswerParser, answer_parser, reasoning_tokens
from runtime.chat_formats import MISTRAL, ChatFormat
from runtime.engine import Engine
from runtime.errors import LLMQRuntimeError
from runtime.finish import FINISH_ERROR, FINISH_LENGTH, FINISH_STOP
from runtime.generator import TokenEvent
from runtime.harmony import HarmonyParser
from runtime.sampling import SamplingParams
from workers import keys
from workers.errors import ConstrainedDecodingError, InvalidJobRequest, JobFailure, JobRefused
from workers.progress import StreamProgress
from workers.requests import ChoicePlan, JobPlan, embedding_inputs, plan_generation
from workers.result_bodies import (
    ChoiceOutput,
    LogprobRenderer,
    embeddings_body,
    generation_body,
)
from workers.wire.errors import error_body
from workers.wire.events import StreamToken, encode, write_ending
from workers.wire.job import EMBEDDINGS, FAILED, JobRecord


def run_job(job_id: str) -> None:
    """What a stock `rq worker` would call. llmq jobs need `llmq worker` (warm engines,
    batching, leases, event streams), so this ends the job as failed, with an error its
    client can see, instead of leaving the client waiting on a stream nobody writes."""
    from rq import get_current_job

    message = f"job {job_id} was taken by a plain rq worker; llmq jobs run on `llmq worker`"
    body = error_body(message, "server_error", code="wrong_worker", status=500)
    current = get_current_job()
    if current is not None and keys.is_valid_job_id(job_id):
        with current.connection.pipeline() as pipe:
            write_ending(pipe, job_id, FAILED, body)
            pipe.execute()
    raise JobRefused(message)


FINISH_TOOL_CALLS = "tool_calls"


@dataclass
class ChoiceState:
    """`parser` splits the choice's text into thinking, content and tool calls in its
    model's format (`runtime.answer_parser`) where the model thinks or the request may make
    calls; `spans` are its tokens' [start, end) in the text the parser was fed, to count
    those that fall in thinking."""

    plan: ChoicePlan
    output: ChoiceOutput
    request_id: str
    parser: AnswerParser | HarmonyParser | None = None
    spans: list[tuple[int, int]] = field(default_factory=list)

    @property
    def parses(self) -> bool:
        """Whether its tokens reach the client as parsed deltas rather than plain text."""
        return self.parser is not None

    def feed(self, text: str, finish: bool) -> tuple[str, str, list[dict[str, Any]]]:
        """Feed the parser one token's text (the end of the text with `finish`)."""
        assert self.parser is not None
        start = self.spans[-1][1] if self.spans else 0
        self.spans.append((start, start + len(text)))
        reasoning, content, calls = self.parser.feed(text)
        if finish:
            more_reasoning, more_content, more_calls = self.parser.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
            calls = calls + more_calls
        return reasoning, content, calls

    @property
    def finished(self) -> bool:
        return self.output.finish_reason is not None


@dataclass(eq=False)  # identity: jobs are kept in sets
class ActiveJob:
    """A claimed job: `lease` is "{worker}:{attempt}", the fence on every write for it."""

    record: JobRecord
    attempt: int
    lease: str
    rq_job: Job | None
    queue: Queue | None
    progress: StreamProgress = field(default_factory=StreamProgress)
    plan: JobPlan | None = None
    choices: list[ChoiceState] = field(default_factory=list)
    pending: list[tuple[str, str]] = field(default_factory=list)  # (kind, JSON) to append
    written: int = 0  # entries in the job's stream, as far as this worker knows
    # the writer's bookkeeping (`workers.event_writer`)
    ttl_set: bool = False  # a write of this attempt set its record's and stream's TTLs
    ending_sent: bool = False  # its final write is sent (in flight or landed)
    counters_at: float | None = None  # when its record's counters were last written (monotonic)
    result: dict[str, Any] | None = None
    claimed_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    ttft_recorded: bool = False
    cached_tokens: int = 0  # prompt tokens of its sequences the prefix cache served ...
    prefill_tokens: int = 0  # ... out of this many
    renderer: LogprobRenderer | None = None
    resumed: dict[str, int] = field(default_factory=dict)  # request id -> tokens sent before
    failure: JobFailure | None = None  # the engine ended a choice with an error: fail the job
    preemptions: int = 0  # times the engine took its choices' KV memory for higher priorities
    format: ChatFormat = field(default_factory=ChatFormat)  # the model's (runtime/chat_formats)

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def model(self) -> str:
        return self.record.model

    @property
    def running(self) -> list[ChoiceState]:
        return [c for c in self.choices if not c.finished]

    @property
    def completion_tokens(self) -> int:
        return sum(c.output.tokens for c in self.choices)

    def start(self, engine: Engine) -> list[tuple[str, list[int], SamplingParams]]:
        """Plan the job on `engine` and resume what earlier attempts streamed; the sequences
        to add to the generator as (request id, prompt ids, params). A resumed sequence's prompt
        ends with the tokens already sent (`resumed` says how many; the engine replays
        them) and its `max_tokens` counts only what is left. Raises InvalidJobRequest."""
        body = self.record.request
        if self.record.endpoint == EMBEDDINGS:
            self._embed(engine, body)
            return []
        self.plan = plan_generation(engine, self.record)
        self.format = engine.chat_template.format
        self.renderer = LogprobRenderer(engine.tokenizer, self.record.endpoint)
        sequences = []
        for plan in self.plan.choices:
            choice = self._resume(plan)
            self.choices.append(choice)
            if choice.finished:
                continue
            sent = choice.output.tokens
            params = dataclasses.replace(plan.params, max_tokens=plan.params.max_tokens - sent)
            sequences.append((choice.request_id, plan.prompt_ids + self._sent_ids(plan), params))
            self.resumed[choice.request_id] = sent
        self.prefill_tokens = sum(len(prompt) for _, prompt, _ in sequences)
        self._maybe_done()
        return sequences

    def on_token(self, choice_index: int, event: TokenEvent) -> bool:
        """Take one engine token, text and finish reason as the engine made them; True if
        it ended its choice. A choice the engine ended with "error" fails the whole job
        (`failure`): its output may not match the constraint the caller relies on."""
        choice = self.choices[choice_index]
        text, finish = event.text, event.finish_reason
        self.preemptions += event.preemptions
        if finish == FINISH_ERROR and self.failure is None:
            self.failure = ConstrainedDecodingError(event.error or "the engine failed")
        out = choice.output
        delta = None
        if choice.parses:
            parse_text = text + self.format.marker_text(event.token_id)
            delta, finish = self._parsed_delta(choice, parse_text, finish)
        entry = None
        if self.plan is not None and self.plan.logprobs is not None and self.renderer:
            entry = self.renderer.entry(
                event.token_id, event.logprob, event.top_logprobs, out.text_length
            )
            out.logprobs.append(entry)
        self.pending.append(
            encode(
                StreamToken(
                    choice=out.index,
                    index=out.tokens,
                    text=text,
                    token_id=event.token_id,
                    logprob=event.logprob,
                    finish_reason=finish,
                    attempt=self.attempt,
                    top_logprobs=tuple(event.top_logprobs) if entry is not None else (),
                    logprobs=entry,
                    delta=delta,
                )
            )
        )
        out.text.append(text)
        out.tokens += 1
        out.finish_reason = finish
        self.cached_tokens += event.cached_tokens
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self._maybe_done()
        return finish is not None

    def _parsed_delta(
        self, choice: ChoiceState, text: str, finish: str | None
    ) -> tuple[dict[str, Any], str | None]:
        """What the token shows a streaming client (reasoning, content and tool-call deltas),
        and the choice's finish reason: "tool_calls" when a choice that made calls stops, or
        when it repeats one of its calls (the choice ends there: `ToolCallParser.repeated`)."""
        assert choice.parser is not None
        reasoning, content, calls = choice.feed(text, finish is not None)
        if finish is None and choice.parser.repeated:
            finish = FINISH_TOOL_CALLS
            rest_reasoning, rest, more = choice.parser.finish()
            reasoning, content, calls = reasoning + rest_reasoning, content + rest, calls + more
        if finish is not None:
            finish = _settle(choice, finish)
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta, finish

    def _call_id(self, choice: int, call: int) -> str:
        """A tool call's id, the same in every attempt of the job (a resumed job re-parses
        the text it streamed before and must name its calls as it did)."""
        digest = hashlib.sha256(f"{self.id}:{choice}:{call}".encode()).hexdigest()
        if self.format.family == MISTRAL:
            return digest[:9]  # Mistral's templates take 9 letters and digits, no more
        return f"call_{digest[:24]}"

    def body(self) -> dict[str, Any]:
        assert self.plan is not None
        return generation_body(
            self.record.endpoint,
            self.id,
            self.record.created_at,
            self.record.responds_as,
            [c.output for c in self.choices],
            self.plan.prompt_tokens,
            self.plan.logprobs is not None,
            self.cached_tokens,
        )

    def _maybe_done(self) -> None:
        if self.result is None and self.failure is None and self.choices and not self.running:
            self.result = self.body()

    def _resume(self, plan: ChoicePlan) -> ChoiceState:
        """The choice's state after replaying the tokens earlier attempts streamed."""
        out = ChoiceOutput(index=plan.index, echo_text=plan.echo_text)
        if plan.echo_logprobs is not None and self.renderer is not None:
            out.echo_logprobs = self.renderer.echo_entries(plan.echo_logprobs)
        parser = None
        if self.plan is not None and self.plan.spec.chat:
            parser = answer_parser(
                self.format,
                lambda call: self._call_id(plan.index, call),
                self.plan.spec.calls_possible,
                self.plan.thinking,
                self.plan.spec.tools,
            )
        choice = ChoiceState(plan, out, f"{self.id}:{plan.index}", parser)
        streamed = self.progress.choices.get(plan.index)
        if streamed is not None:
            out.text = list(streamed.texts)
            out.logprobs = list(streamed.logprobs)
            out.tokens = len(streamed.token_ids)
            out.finish_reason = streamed.finish_reason
            if out.finish_reason is None and out.tokens >= plan.params.max_tokens:
                out.finish_reason = FINISH_LENGTH  # all sent, the last event just said so late
            if parser is not None:  # the parser where the earlier attempt left it
                for text, token_id in zip(out.text, streamed.token_ids, strict=False):
                    choice.feed(text + self.format.marker_text(token_id), False)
                if out.finish_reason is not None:
                    parser.finish()
                    _settle(choice, out.finish_reason)
        return choice

    def _sent_ids(self, plan: ChoicePlan) -> list[int]:
        streamed = self.progress.choices.get(plan.index)
        return list(streamed.token_ids) if streamed else []

    def _embed(self, engine: Engine, body: dict[str, Any]) -> None:
        inputs = embedding_inputs(engine, body)
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise InvalidJobRequest(
                f"encoding_format must be 'float' or 'base64', got {fmt!r}",
                param="encoding_format",
            )
        try:
            vectors = engine.embed(inputs)
        except LLMQRuntimeError as exc:
            raise InvalidJobRequest(str(exc), param="input") from exc
        self.result = embeddings_body(self.model, vectors, sum(len(i) for i in inputs), fmt)


def _settle(choice: ChoiceState, finish: str) -> str:
    """Put a finished choice's thinking, content and calls in its output; its finish
    reason: "tool_calls" for a choice with calls that stopped, and for one cut by
    `max_tokens` whose calls are all complete (a later call cut short was dropped: what the
    client gets is complete calls to run); "length" when its only call was cut short."""
    parser, out = choice.parser, choice.output
    assert parser is not None
    out.parsed = True
    out.reasoning_content = parser.reasoning
    if parser.thinks:
        out.reasoning_tokens = reasoning_tokens(choice.spans, parser.reasoning_spans)
    calls = parser.tool_calls()
    out.tool_calls = calls or None
    out.content = parser.content if parser.content or not calls else None
    if calls and finish in (FINISH_STOP, FINISH_TOOL_CALLS):
        return FINISH_TOOL_CALLS
    if calls and finish == FINISH_LENGTH and parser.complete:
        return FINISH_TOOL_CALLS
    return finish
