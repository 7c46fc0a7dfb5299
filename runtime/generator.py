"""Continuous batching: `add`, `step`, `abort`; each step is one batched forward pass.

Sequences move waiting -> prefilling -> decoding -> finished, and back to waiting when they
are preempted. A step first gives every decoding sequence its next token (running streams
never stall behind a long prompt), then fills the rest of the token budget with prompt
chunks (`max_prefill_tokens` per step, `max_batch_tokens` in all), admitting waiting
sequences by priority (an integer, lower sooner, as vLLM's; the workers put batch work
below every interactive priority), then arrival. KV memory comes from the engine's block
pool; when it runs out, the sequence with the highest priority value, most recently arrived
among equals, is preempted: its full blocks go to the prefix cache, its memory is freed, and it
waits to be recomputed (prompt + what it generated so far), usually from cached blocks.

Only rows whose next token is wanted go through the LM head, and only those whose logits are
seen or sampled past their argmax (logprobs, a draw, a penalty, a grammar) pay for the
file's own head where the plan's is a cheaper copy (runtime/kernels/heads.py). Tokens
become text events through each sequence's `TextAssembler` (UTF-8-safe detokenizing and
stop strings), the one text path: callers publish the text they are given. A request that
resumes an earlier run (`add(..., resume=k)`: its last k prompt tokens were generated and
sent before) has those tokens replayed through its assembler, so its text continues
exactly where the run stopped.

A request with a `constraint` (structured output) gets a grammar matcher at `add` (a resumed
one replays its sent tokens into it). Each step computes the masks of the constrained rows
in one parallel call and sets their forbidden logits to -inf before sampling; rows without
a constraint pay nothing. The matcher follows each sampled token once (a preempted sequence
is recomputed, not re-sampled, so it is never fed twice) and ends the sequence with "stop"
when the grammar is complete. `grammar_seconds` totals the time spent on grammars.

With a device's static decode steps (runtime/decode_graphs.py), consecutive pure decode
steps overlap: step N+1 is launched from step N's sampled tokens while they are still on
the device, and only then are step N's tokens read back and emitted, so the host's half of
a step runs beside the device's (vLLM's async scheduling). What the host learns one step
late (a stop, a cancel) costs one wasted row, never a different token
(tests/runtime/test_overlap.py).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from runtime.constraints import GrammarMatcher, validate_constraint
from runtime.detokenizer import TextAssembler
from runtime.errors import ContextLengthError, EmptyPromptError, check_context_length
from runtime.finish import FINISH_ERROR, FINISH_LENGTH, FINISH_STOP
from runtime.grammar_vocab import GrammarVocab
from runtime.kernels.core_share import before_forward_pass
from runtime.kv_pool import BlockPool, OutOfBlocksError, PagedKVCache
from runtime.lora import AdapterStack, LoraAdapter, normalize_stack, stack_namespace
from runtime.models.base import SequenceChunk
from runtime.prefix_cache import PrefixCache
from runtime.sampling import (
    Sampler,
    SampleResult,
    SamplingParams,
    SequenceSamplingState,
)
from runtime.step_runners import CausalLM, HostRows, HostSteps, StepRow, eager_logits
from runtime.tokenizer import Tokenizer

if TYPE_CHECKING:  # torch stays out of the host path's imports
    from runtime.device_sampling import PendingTokens
    from runtime.device_steps import DeviceSteps

DEFAULT_PRIORITY = 0


@dataclass
class GeneratorConfig:
    max_sequences: int = 64  # sequences running at once
    max_batch_tokens: int = 2048  # tokens in one forward pass (decode + prefill)
    max_prefill_tokens: int = 512  # prompt tokens in one forward pass
    # a static decode step is launched before the last one's tokens reach the host (`step`)
    overlap: bool = True


@dataclass
class TokenEvent:
    """One generated token of one request, with the text it releases (may be empty)."""

    request_id: str
    index: int  # 0 for the first generated token
    token_id: int
    text: str
    logprob: float | None  # None unless the request asked for logprobs
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0  # prompt tokens served by the prefix cache (first event only)
    error: str | None = None  # why the engine ended it, with finish_reason "error"
    preemptions: int = 0  # times it lost its KV memory to higher priorities (last event only)


@dataclass
class _InFlight:
    """A decode step launched on the device whose sampled tokens the host has not read."""

    sequences: list[_Sequence]  # its rows, in order
    tokens: PendingTokens


@dataclass(eq=False)  # identity: sequences are found in the waiting/running lists
class _Sequence:
    request_id: str
    prompt_ids: list[int]  # grows by the generated tokens when the sequence is preempted
    priority: int
    arrival: int
    sampling: SequenceSamplingState
    text: TextAssembler
    cache_prompt: bool
    cache: PagedKVCache | None = None
    consumed: int = 0  # tokens of prompt_ids already in the cache
    next_token: int | None = None  # sampled, not yet fed to the model
    cached_tokens: int | None = None  # set at first admission
    original_length: int = 0  # prompt tokens the user sent
    grammar: GrammarMatcher | None = None  # the constraint's matcher, if any
    adapters: AdapterStack = ()  # LoRA (adapter, scale) applied to every token it feeds
    cache_namespace: str | None = None  # prefix-cache namespace: the model's + the adapters'
    preemptions: int = 0  # times `_preempt` took its memory

    @property
    def prefilling(self) -> bool:
        return self.consumed < len(self.prompt_ids)

    @property
    def row(self) -> StepRow:
        return StepRow(self.request_id, self.sampling, self.grammar)


class Generator:
    """Continuous batching over one model with paged KV memory and a prefix cache."""

    def __init__(
        self,
        model: CausalLM,
        tokenizer: Tokenizer,
        sampler: Sampler,
        pool: BlockPool,
        prefix_cache: PrefixCache | None = None,
        max_context: int | None = None,
        config: GeneratorConfig | None = None,
        grammar_vocab: GrammarVocab | None = None,
        runner: HostSteps | DeviceSteps | None = None,
    ) -> None:
        """`runner`: where a step's logits stay and how its rows are sampled, chosen by
        the engine for its path (runtime/step_runners.py); the host path's by default."""
        self.model, self.tokenizer, self.sampler = model, tokenizer, sampler
        self.pool, self.prefix_cache = pool, prefix_cache
        self.max_context = min(max_context or model.context_length, model.context_length)
        self.config = config or GeneratorConfig()
        self._waiting: list[_Sequence] = []
        self._running: list[_Sequence] = []
        self._arrivals = itertools.count()
        self.preemptions = 0
        # built on the first constrained request; an engine shares one between generators
        self.grammar_vocab = grammar_vocab or GrammarVocab(tokenizer, model.vocab_size)
        self.runner = runner or HostSteps(HostRows(sampler, self.grammar_vocab))
        self._in_flight: _InFlight | None = None  # a launched step not yet read back
        self.overlapped_steps = 0  # steps launched before the previous one was read

    @property
    def grammar_seconds(self) -> float:
        """Time spent on grammars (masks + matcher updates), all steps."""
        return self.runner.host_rows.grammar_seconds

    @property
    def grammar_rows(self) -> int:
        """Constrained rows masked, all steps."""
        return self.runner.host_rows.grammar_rows

    def __len__(self) -> int:
        return len(self._waiting) + len(self._running)

    def check_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise the error a request would get, without adding it."""
        self._check_sizes(prompt_ids, params)
        if params.constraint is not None:
            validate_constraint(params.constraint, self.grammar_vocab)

    def _check_sizes(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise EmptyPromptError("the prompt is empty: it must contain at least one token")
        check_context_length(len(prompt_ids), params.max_tokens, self.max_context)
        total = len(prompt_ids) + params.max_tokens
        if total > self.pool.n_blocks * self.pool.block_size:
            raise ContextLengthError(
                f"{total} tokens do not fit this engine's KV memory "
                f"({self.pool.n_blocks * self.pool.block_size} tokens); raise its KV budget"
            )
        params.check_vocab(self.model.vocab_size)

    def add(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        priority: int = DEFAULT_PRIORITY,
        cache_prompt: bool = True,
        resume: int = 0,
        adapters: Sequence[tuple[LoraAdapter, float]] = (),
    ) -> None:
        """Queue a request. `resume`: how many of the last prompt tokens an earlier run of
        it generated and sent; their text is not emitted again, and what they held back
        (part of a UTF-8 character, the start of a stop string) carries on; a constraint's
        matcher is fed them, and the sampler's random stream and counts move past them.
        `adapters`: LoRA adapters (loaded for this model, see `Engine.adapter_stack`) with
        their scales, added up; its rows alone get them."""
        if any(s.request_id == request_id for s in self._running + self._waiting):
            raise ValueError(f"request {request_id!r} is already running")
        self._check_sizes(prompt_ids, params)  # the matcher below checks the constraint
        if not 0 <= resume < len(prompt_ids):
            raise ValueError(f"resume must be in [0, {len(prompt_ids)}), got {resume}")
        stack = normalize_stack(adapters)
        prompt = [int(t) for t in prompt_ids]
        text = TextAssembler(self.tokenizer, params.stop, params.marker_token_ids)
        sent = prompt[len(prompt) - resume :]
        text.replay(sent)
        sampling = self.sampler.new_state(params, prompt)
        sampling.replay(sent)
        grammar = None
        if params.constraint is not None:
            grammar = GrammarMatcher(self.grammar_vocab, params.constraint, replay=sent)
        seq = _Sequence(
            request_id=request_id,
            prompt_ids=prompt,
            priority=priority,
            arrival=next(self._arrivals),
            sampling=sampling,
            text=text,
            cache_prompt=cache_prompt and self.prefix_cache is not None,
            original_length=len(prompt),
            grammar=grammar,
            adapters=stack,
        )
        if self.prefix_cache is not None and stack:
            seq.cache_namespace = self.prefix_cache.namespace + stack_namespace(stack)
        self._waiting.append(seq)
        self._waiting.sort(key=lambda s: (s.priority, s.arrival))

    def abort(self, request_id: str) -> bool:
        """Drop a request now; its KV memory is freed. False if it was not there."""
        for group in (self._running, self._waiting):
            for seq in group:
                if seq.request_id == request_id:
                    group.remove(seq)
                    if seq.cache is not None:
                        seq.cache.release()
                    return True
        return False

    def step(self) -> list[TokenEvent]:
        """One forward pass over the scheduled sequences; the tokens it produced.

        Overlapped (`GeneratorConfig.overlap`, static decode steps whose rows are all
        sampled on the device): the step is launched and its tokens stay on the device;
        the next call launches the following step from them before it reads them back and
        returns their events, so the host's emission and scheduling run while the device
        computes. The tokens are those of the step-by-step loop: a row the read-back
        finishes (a stop token or string, a cancel) has already been fed to the step in
        flight, whose output for it is dropped, one wasted row. Anything the host must
        decide first (a waiting request, a prefilling row, a grammar mask, host sampling,
        a preemption) drains the pipeline and takes the step-by-step path."""
        events: list[TokenEvent] = []
        pending, self._in_flight = self._in_flight, None
        if pending is not None:
            following = self._launch_after(pending)
            events = self._read_back(pending)
            if following is not None:
                self._in_flight = following
                return events
        tokens, chunks, wanted = self._schedule()
        if not chunks:
            return events
        before_forward_pass()  # the thread count follows the machine's load (core_share.py)
        sequences = [seq for _, seq in wanted]
        rows = [seq.row for seq in sequences]  # the wanted rows, in `wanted`'s order
        bucket = self.runner.static_bucket(chunks)
        if bucket is not None:  # every row decodes one token: all are wanted
            logits = self.runner.run_static(tokens, chunks, bucket)
            if self.config.overlap and all(map(self.runner.samples_on_device, rows)):
                pending = self.runner.sample_later(logits, rows)
                self._in_flight = _InFlight(sequences, pending)
                return events
        else:
            logits = eager_logits(self.model, tokens, chunks, [i for i, _ in wanted], rows)
            if logits is None:  # only prompt chunks: no row is wanted yet
                return events
        samples = self.runner.sample(logits, rows)
        events.extend(self._emit(s, sample) for s, sample in zip(sequences, samples, strict=True))
        return events

    def _launch_after(self, pending: _InFlight) -> _InFlight | None:
        """The decode step that follows `pending`, launched with the tokens it sampled
        (still on the device) when nothing needs the host first; None otherwise."""
        in_flight = set(pending.sequences)
        if self._waiting or any(seq not in in_flight for seq in self._running):
            return None  # a request to admit or a prompt to prefill: schedule it
        running = set(self._running)
        rows = [
            (i, seq)
            for i, seq in enumerate(pending.sequences)
            if seq in running and not _ends_by_length(seq)
        ]
        if not rows:
            return None
        for _, seq in rows:
            if not self._reserve(seq, seq.cache.length + 1, preempt=False):
                return None  # memory is short: the step-by-step path preempts
        sequences = [seq for _, seq in rows]
        chunks = [SequenceChunk(s.cache, s.cache.length, 1, s.adapters) for s in sequences]
        bucket = self.runner.static_bucket(chunks)
        if bucket is None:
            return None
        before_forward_pass()
        sources = [i for i, _ in rows]
        logits = self.runner.run_static(sources, chunks, bucket, previous=pending.tokens.tokens)
        self.overlapped_steps += 1
        tokens = self.runner.sample_later(logits, [seq.row for seq in sequences])
        return _InFlight(sequences, tokens)

    def _read_back(self, pending: _InFlight) -> list[TokenEvent]:
        """The events of a launched step's rows that are still running (a row finished or
        aborted meanwhile was fed once more; its token is dropped)."""
        token_ids = pending.tokens.host_ids()
        running = set(self._running)
        return [
            self._emit(seq, SampleResult(token_id, None))
            for seq, token_id in zip(pending.sequences, token_ids, strict=True)
            if seq in running
        ]

    # ------------------------------------------------------------------ scheduling

    def _schedule(self) -> tuple[list[int], list[SequenceChunk], list[tuple[int, _Sequence]]]:
        tokens: list[int] = []
        chunks: list[SequenceChunk] = []
        wanted: list[tuple[int, _Sequence]] = []
        preempted_before = self.preemptions
        for seq in sorted(self._running, key=lambda s: (s.priority, s.arrival)):
            if seq.cache is None or seq.prefilling:  # preempted meanwhile (its cache freed)
                continue
            if not self._reserve(seq, seq.cache.length + 1):
                continue
            chunks.append(SequenceChunk(seq.cache, seq.cache.length, 1, seq.adapters))
            tokens.append(seq.next_token)
            wanted.append((len(tokens) - 1, seq))
        budget = min(self.config.max_prefill_tokens, self.config.max_batch_tokens - len(tokens))
        # a step that had to preempt admits nobody new: memory is short
        waiting = self._waiting if self.preemptions == preempted_before else []
        candidates = [s for s in self._running if s.prefilling] + list(waiting)
        for seq in sorted(candidates, key=lambda s: (s.priority, s.arrival)):
            if budget <= 0:
                break
            admitted = seq.cache is None
            if admitted and not self._admit(seq):
                break  # no room: later arrivals of equal or lower priority wait too
            piece = seq.prompt_ids[seq.consumed : seq.consumed + budget]
            # no preemption here: decoding rows of this step may already use their blocks
            if not self._reserve(seq, seq.consumed + len(piece), preempt=False):
                if admitted:
                    self._requeue(seq)
                break
            budget -= len(piece)
            chunks.append(SequenceChunk(seq.cache, seq.consumed, len(piece), seq.adapters))
            seq.consumed += len(piece)
            tokens.extend(piece)
            if not seq.prefilling:
                wanted.append((len(tokens) - 1, seq))
                self._remember(seq, seq.prompt_ids)
        return tokens, chunks, wanted

    def _admit(self, seq: _Sequence) -> bool:
        if len(self._running) >= self.config.max_sequences:
            return False
        shared = []
        if seq.cache_prompt:
            shared = self.prefix_cache.lookup(seq.prompt_ids, seq.cache_namespace)
        seq.cache = PagedKVCache(self.pool, shared)
        seq.consumed = seq.cache.length
        if seq.cached_tokens is None:
            seq.cached_tokens = seq.consumed
        self._waiting.remove(seq)
        self._running.append(seq)
        return True

    def _reserve(self, seq: _Sequence, n_tokens: int, preempt: bool = True) -> bool:
        """Blocks for `n_tokens` positions of `seq`, evicting cached blocks and then (if
        allowed) preempting lower-priority sequences; False if `seq` did not get them."""
        while True:
            try:
                seq.cache.reserve(n_tokens)
                return True
            except OutOfBlocksError:
                if self.prefix_cache is not None and self.prefix_cache.evict(4):
                    continue
                if not preempt:
                    return False
                victim = max(self._running, key=lambda s: (s.priority, s.arrival))
                self._preempt(victim)
                if victim is seq:
                    return False

    def _preempt(self, seq: _Sequence) -> None:
        """Free `seq`'s KV memory; it is recomputed later from prompt + generated tokens."""
        self.preemptions += 1
        seq.preemptions += 1
        self._remember(seq, self._fed(seq))
        seq.prompt_ids = seq.prompt_ids[: seq.original_length] + seq.sampling.output_token_ids
        self._requeue(seq)

    def _requeue(self, seq: _Sequence) -> None:
        seq.cache.release()
        seq.cache, seq.consumed = None, 0
        self._running.remove(seq)
        self._waiting.append(seq)
        self._waiting.sort(key=lambda s: (s.priority, s.arrival))

    def _fed(self, seq: _Sequence) -> list[int]:
        """The tokens whose KV is in `seq`'s cache, in order."""
        if seq.prefilling:
            return seq.prompt_ids[: seq.consumed]
        generated = seq.sampling.output_token_ids
        extra = generated[len(seq.prompt_ids) - seq.original_length :]
        return seq.prompt_ids + extra[:-1]  # the last sampled token is not fed yet

    def _remember(self, seq: _Sequence, token_ids: list[int]) -> None:
        if seq.cache_prompt and seq.cache is not None:
            self.prefix_cache.insert(token_ids, seq.cache.shared_blocks(), seq.cache_namespace)

    # ------------------------------------------------------------------ output

    def _emit(self, seq: _Sequence, sample: SampleResult) -> TokenEvent:
        index = len(seq.sampling.output_token_ids)
        finish = seq.sampling.append(sample.token_id)
        if seq.grammar is not None and finish != FINISH_STOP:
            text, finish = self._follow_grammar(seq, sample.token_id, finish)
        else:
            text, finish = seq.text.push(sample.token_id, finish)
        if finish is None:
            seq.next_token = sample.token_id
        else:
            self._finish(seq)
        return TokenEvent(
            seq.request_id,
            index,
            sample.token_id,
            text,
            sample.logprob,
            sample.top_logprobs,
            finish,
            seq.cached_tokens if index == 0 else 0,
            seq.grammar.error if finish == FINISH_ERROR else None,
            seq.preemptions if finish else 0,
        )

    def _follow_grammar(
        self, seq: _Sequence, token_id: int, finish: str | None
    ) -> tuple[str, str | None]:
        """Feed the sampled token to the sequence's matcher; its text and finish reason."""
        started = time.perf_counter()
        seq.grammar.consume(token_id)
        done, error = seq.grammar.done, seq.grammar.error
        self.runner.host_rows.grammar_seconds += time.perf_counter() - started
        if error is not None:
            return "", FINISH_ERROR
        if done:  # its text is released in full, as for the last allowed token
            text, _ = seq.text.push(token_id, FINISH_LENGTH)
            return text, FINISH_STOP
        return seq.text.push(token_id, finish)

    def _finish(self, seq: _Sequence) -> None:
        self._remember(seq, self._fed(seq))
        seq.cache.release()
        self._running.remove(seq)


def _ends_by_length(seq: _Sequence) -> bool:
    """Whether the token `seq` has in flight is its last by `max_tokens`: its next step
    is known to be wasted, so it is not launched."""
    return len(seq.sampling.output_token_ids) + 1 >= seq.sampling.params.max_tokens
